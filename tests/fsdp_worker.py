"""A worker of tests/test_train.py's FSDP tests, started by torchrun: train() with fsdp on, as the
test's JSON options say, optionally stopping after a step; the first step reports how many
parameter entries this worker holds, against the model's."""

import json
import sys

from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from comera_convert.training import TrainOptions, train
from comera_convert.training.run import leave_process_group


class Report(TrainerCallback):
    """After the first step: this worker's local entries and the model's, and which kinds of
    parameters it holds (sharded, or replicated gates)."""

    def __init__(self, path: str, stop_at: int | None):
        self.path, self.stop_at = path, stop_at

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            params = list(model.named_parameters())
            local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for _, p in params)
            replicated = sorted({n.rpartition(".gates.")[1] or n for n, p in params if not isinstance(p, DTensor)})
            with open(f"{self.path}.{state.is_world_process_zero}", "w") as f:
                json.dump({"local": local, "total": sum(p.numel() for _, p in params), "replicated": replicated}, f)
        if state.global_step == self.stop_at:
            control.should_training_stop = True


if __name__ == "__main__":
    model, out, options, report = sys.argv[1:5]
    settings = json.loads(options)
    stop_at, resume = settings.pop("stop_at", None), settings.pop("resume", False)
    train(model, TrainOptions(fsdp=True, **settings), out, resume=resume, callbacks=[Report(report, stop_at)])
    leave_process_group()
