"""What one worker holds while `comera train` runs under torchrun, with DDP and with --fsdp: the
bytes of its parameters, gradients and AdamW state (counted from the tensors), its peak resident
memory (VmHWM), and the time of a step.

    python examples/bench_fsdp_train.py [--size 125m|1.1b] [--workers 2] [--steps 6] [--work DIR]

The model is a generated Llama-shaped checkpoint (bench_stream_convert.py's shapes, float32),
converted with `comera convert --ratio 4 --no-calibration`, then trained for a few steps (clm on the
built-in english corpus, one 128-token block per worker and step) once as DDP and once with --fsdp,
each in fresh processes. On the CPU each worker gets one thread.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_stream_convert import SHAPES, add_tokenizer, generate


def local_bytes(tensors) -> int:
    """Bytes of the memory behind this worker's part of ``tensors``, each block counted once (FSDP
    keeps gradients as views of one buffer)."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for tensor in tensors:
        storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measuring_callback(report: Path):
    from transformers import TrainerCallback

    class Measure(TrainerCallback):
        """Gradients just before the optimizer step (the Trainer frees them after it), parameters and
        AdamW's state at the end of the step, and each step's time."""

        def __init__(self):
            self.record, self.times, self.start = {}, [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.record["gradients"] = local_bytes(p.grad for p in model.parameters() if p.grad is not None)

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.times.append(time.perf_counter() - self.start)
            self.record["parameters"] = local_bytes(model.parameters())
            self.record["optimizer"] = local_bytes(t for s in optimizer.state.values() for t in s.values()
                                                   if hasattr(t, "untyped_storage") and t.dim() > 0)

        def on_train_end(self, args, state, control, **kwargs):
            peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
            self.record.update(step_s=statistics.median(self.times[1:] or self.times), peak=peak_kb * 1024)
            (report.parent / f"{report.name}.{os.environ['RANK']}").write_text(json.dumps(self.record))

    return Measure()


def worker(model: str, out: str, fsdp: bool, steps: int, report: Path) -> None:
    from comera_convert.training import TrainOptions, train
    from comera_convert.training.run import leave_process_group

    options = TrainOptions(objective="clm", data="english", steps=steps, seq_len=128, batch_size=1, fsdp=fsdp,
                           save_steps=steps + 1, logging_steps=steps, max_eval_blocks=1)
    train(model, options, out, overwrite=True, callbacks=[measuring_callback(report)])
    leave_process_group()


def launch(tt: Path, work: Path, fsdp: bool, workers: int, steps: int) -> list[dict]:
    name = "fsdp" if fsdp else "ddp"
    report = work / f"report-{name}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(workers), __file__,
               "--worker", str(tt), str(work / f"trained-{name}"), str(int(fsdp)), str(steps), str(report)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return [json.loads((work / f"report-{name}.{rank}").read_text()) for rank in range(workers)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=SHAPES, default="125m")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--work", type=Path, default=Path("bench-fsdp"))
    parser.add_argument("--modes", default="ddp,fsdp", help="which runs, comma-separated")
    args = parser.parse_args()
    source, tt = args.work / f"llama-{args.size}-f32", args.work / f"llama-{args.size}-tt4"
    generate(source, args.size, dtype="float32")
    add_tokenizer(source)
    if not (tt / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "comera_convert", "--quiet", "convert", str(source), "--ratio", "4",
                        "--no-calibration", "--out", str(tt)], check=True)
    gib = 1024 ** 3
    print(f"{args.size} at ratio 4, {args.workers} workers; per worker (the most of any): "
          "parameters / gradients / AdamW state / all three / peak resident (GiB), step time (s)")
    for fsdp in [mode == "fsdp" for mode in args.modes.split(",")]:
        ranks = launch(tt, args.work, fsdp, args.workers, args.steps)
        most = {key: max(r[key] for r in ranks) for key in ranks[0]}
        held = most["parameters"] + most["gradients"] + most["optimizer"]
        print(f"{'fsdp' if fsdp else 'ddp ':4}  {most['parameters'] / gib:.3f} / {most['gradients'] / gib:.3f} / "
              f"{most['optimizer'] / gib:.3f} / {held / gib:.3f} / {most['peak'] / gib:.2f}  {most['step_s']:.2f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        model, out, fsdp, steps, report = sys.argv[2:7]
        worker(model, out, bool(int(fsdp)), int(steps), Path(report))
    else:
        main()
