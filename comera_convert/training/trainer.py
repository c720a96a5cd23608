"""ComeraTrainer: transformers' Trainer with CoMERA's staged rank-adaptive objective.

What it adds to Trainer:
  * three AdamW parameter groups (TT cores, rank gates, the dense rest) with their own rates;
  * compute_loss = the objective's task loss L, plus the rank term of the current stage;
  * after every optimizer step, gate entries below tau are closed for good, and the stage
    switches by step count or plateau (RankCallback);
  * checkpoints are compressed checkpoints truncated to the open ranks, with the kept indices
    in comera_train_state.json, so resuming scatters them back into the full-rank layers and the
    optimizer state (saved at full rank by Trainer) still fits;
  * at the stage switch and at each quarter of the late stage, closed ranks are cut out of the
    cores, gates and AdamW's moments (``rank_cuts.py``), so steps get cheaper as ranks close; the
    checkpoints record each layer's bond sizes, so a run resumed after a cut is cut the same way;
  * non-finite losses skip their step with a warning and stop the run after a few in a row;
  * under --fsdp (``sharding``), checkpoints are cut from the parameters gathered on the main
    worker, and AdamW's state, the schedule and each worker's random state are saved beside them
    (the Trainer saves none of these for a model sharded before it).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback

from ..errors import ComeraError
from ..hf.compat import TrainerCheckpointHooks
from ..hf.files import write_text_atomic
from ..hf.saving import save_compressed
from ..layers import PrunedLinear, TTModule
from .neuron_gates import NeuronBond, pruned_pairs
from .objectives import task_loss
from .rank_control import RankController, gated_modules
from .rank_cuts import CUT_POINTS, cut_closed_ranks, points_reached
from .reprojection import GRAM_EVERY, GramRecorder, reproject
from .stages import RankState
from .wall_clock import WallClock, wall_time_scheduler

logger = logging.getLogger("comera_convert.training")
STATE_FILE = "comera_train_state.json"


class TrainingDiverged(ComeraError):
    """The loss stayed non-finite for too many steps in a row."""


def parameter_groups(model, options) -> list[dict]:
    """AdamW's three groups: the compressed layers' factors (TT cores, and a pruned feed-forward
    layer's weight, which is what its pair keeps of the dense one) at ``lr_cores``, the rank gates at
    ``lr_gates``, the rest (norms, biases, layers left dense) at ``lr_rest``."""
    cores, gates, rest = [], [], []
    pruned = {id(module.weight) for module in model.modules() if isinstance(module, PrunedLinear)}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if ".gates." in f".{name}":
            gates.append(param)
        elif ".cores." in f".{name}" or id(param) in pruned:
            cores.append(param)
        else:
            rest.append(param)
    if not gates:
        raise ComeraError("no rank gates among the trainable parameters: rank adaptation would not run")
    return [
        {"params": cores, "lr": options.lr_cores, "weight_decay": options.weight_decay, "name": "cores"},
        {"params": gates, "lr": options.lr_gates, "weight_decay": 0.0, "name": "gates"},
        {"params": rest, "lr": options.lr_rest, "weight_decay": options.weight_decay, "name": "rest"},
    ]


def truncated_copy(model, fold: bool):
    """A copy of the model with closed ranks physically removed, and the kept indices per module."""
    export = copy.deepcopy(model)
    kept = {}
    for name, module in gated_modules(export):  # TT layers and pruned pairs' neuron gates alike
        kept[name] = [idx.tolist() for idx in module.kept_indices()]
        module.prune_ranks(fold=fold)
    config = getattr(getattr(export, "config", None), "quantization_config", None)
    if config is not None and hasattr(config, "attach"):
        config.attach(export)  # the copy's records must describe the copy
    return export, kept


class ComeraTrainer(TrainerCheckpointHooks, Trainer):
    def __init__(self, *args, comera_options, controller: RankController, objective: str, teacher=None,
                 sharding=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sharding = sharding
        self.comera_options = comera_options
        self.controller = controller
        self.objective = objective
        self.teacher = teacher
        self.history: list[dict] = []
        self.clock = WallClock(comera_options.minutes)
        controller.schedule.clock = self.clock  # --minutes: the stages and the size budget follow the time spent
        self.last_task_loss: float | None = None
        self.nan_streak = 0
        self.cuts_ranks = comera_options.cut_ranks and sharding is None and not distributed()
        if comera_options.cut_ranks and not self.cuts_ranks:
            skipped = ", and the pairs are not re-projected" if comera_options.reprojects else ""
            logger.info("under torchrun closed ranks stay masks while training (DDP and FSDP keep their "
                        f"shapes){skipped}; the export is cut to the open ranks")
        # --reproject: the gated pairs' input Gram matrices, from one step in GRAM_EVERY until the switch
        # (the first of CUT_POINTS), or with --reproject-at cuts until the last.
        self.grams = GramRecorder(controller.modules) if comera_options.reprojects and self.cuts_ranks else None
        self.last_reprojection = len(CUT_POINTS) if comera_options.reproject_at == "cuts" else 1
        self.add_callback(RankCallback(self))

    # -- optimizer ------------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            groups = parameter_groups(model or self.model, self.comera_options)
            self.optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8,
                                               fused=fused_adamw_applies(groups) or None)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """transformers' schedule, or with --minutes one that runs over the time budget (wall_clock.py)."""
        options = self.comera_options
        if options.minutes is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            self.lr_scheduler = wall_time_scheduler(optimizer or self.optimizer, self.clock, num_training_steps,
                                                    options.warmup_steps, options.lr_scheduler_type)
        return self.lr_scheduler

    def cut_ranks_when_due(self, step: int) -> None:
        """At each of rank_cuts.CUT_POINTS the late stage passes, cut the closed ranks out of the model."""
        controller = self.controller
        reached = points_reached(controller.schedule.late_progress(step))
        if reached <= controller.state.cut_points:
            return
        controller.state.cut_points = reached
        if not self.cuts_ranks or distributed():  # checked again: torchrun's group may start after __init__
            return
        cut = cut_closed_ranks(controller, self.optimizer, step)
        if cut is not None:
            controller.state.cuts.append(cut.to_dict())
            if self.history:  # the history JSON marks the step it followed
                self.history[-1]["rank_cut"] = cut.to_dict()
        if self.grams is not None:  # --reproject: at the switch, and with --reproject-at cuts at every cut
            reproject(controller, self.optimizer, self.grams, step)
            self.grams.grams.clear()  # the next re-projection orders by the inputs after this one
            if reached >= self.last_reprojection:
                self.grams.remove()
                self.grams = None

    # -- loss -------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.grams is not None:  # until the switch (or with --reproject-at cuts, the last cut)
            self.grams.active = (model.training and self.state.global_step % GRAM_EVERY == 0
                                 and self.controller.state.cut_points < self.last_reprojection)
        loss = task_loss(self.objective, model, inputs, self.teacher,
                         blockwise=self.comera_options.distill_mode == "block-wise",
                         states=self.comera_options.distill_states, pooled=self.comera_options.distill_pooled)
        total = self.controller.objective(loss)
        if not torch.isfinite(total):
            self.nan_streak += 1
            if self.nan_streak > self.comera_options.max_nan_steps:
                raise TrainingDiverged(
                    f"the loss was not finite for {self.nan_streak} steps in a row at step "
                    f"{self.state.global_step}: stopped; the last good checkpoint is kept "
                    f"(lower the learning rates, or resume from it)")
            logger.warning("non-finite loss at step %d: step skipped (%d in a row)",
                           self.state.global_step, self.nan_streak)
            # A zero loss with no graph: backward gives no gradients, AdamW skips every parameter.
            total = torch.zeros((), device=loss.device, requires_grad=True)
            return (total, None) if return_outputs else total
        self.nan_streak = 0
        self.last_task_loss = float(loss.detach())
        return (total, None) if return_outputs else total

    # -- checkpoints ------------------------------------------------------------------------------------
    def write_checkpoint(self, model, trial, save) -> None:
        """A checkpoint that cannot be written completely (disk full) is removed, never left as latest."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(self.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        # Every worker writes into this folder (its RNG state): it exists before anyone writes, and
        # the model files are replaced into it one by one, atomically.
        folder.mkdir(parents=True, exist_ok=True)
        try:
            if self.sharding is not None:
                self._save_sharded_training_state(folder)  # before trainer_state.json marks it complete
            save()
        except OSError as err:
            if self.is_world_process_zero():
                shutil.rmtree(folder, ignore_errors=True)
            where = f": {err.filename}" if err.filename else ""
            raise ComeraError(f"could not write {folder.name} ({err.strerror or err}{where}): removed the partial "
                              f"checkpoint; the earlier complete ones are kept for --resume") from None

    def _save_sharded_training_state(self, folder: Path) -> None:
        """What the Trainer keeps for resuming, for a model sharded with FSDP: every worker writes its
        part of AdamW's state and its random state; the main one the learning-rate schedule."""
        from transformers.trainer import SCHEDULER_NAME

        self.sharding.save_optimizer(self.model, self.optimizer, folder)
        self.save_rng_state(str(folder))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), folder / SCHEDULER_NAME)

    def read_training_state(self, checkpoint: str | None, load) -> None:
        """AdamW's state and the schedule: the Trainer's own way (``load``) unless the model is sharded."""
        if self.sharding is None or checkpoint is None:
            return load()
        from transformers.trainer import SCHEDULER_NAME

        self.sharding.load_optimizer(self.model, self.optimizer, Path(checkpoint))
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_NAME, weights_only=True))

    def write_model(self, output_dir: str | None = None) -> None:
        """The model truncated to its open ranks, in floats, with the controller's state beside it."""
        model = self.accelerator.unwrap_model(self.model)
        if self.sharding is not None:
            model = self.sharding.full_model(model)  # every worker takes part in the gather
        if not self.args.should_save:
            return  # only the main process writes the model
        output_dir = output_dir or self.args.output_dir
        export, kept = truncated_copy(model, fold=False)
        save_compressed(export, output_dir, overwrite=True, integers=False)  # floats: --resume continues exactly
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        bond_dims = {name: list(module.bond_dims) for name, module in self.controller.modules}
        state = {"kept": kept, "bond_dims": bond_dims, "controller": self.controller.state.to_dict(),
                 "importance": self.controller.importance_lists(), "history": self.history,
                 "schedule": self.comera_options.schedule()}
        write_text_atomic(Path(output_dir) / STATE_FILE, json.dumps(state))

    def read_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The truncated model and the controller's state back from a checkpoint folder."""
        if self.sharding is None:  # a sharded model was loaded before it was sharded
            load_truncated_checkpoint(model or self.model, resume_from_checkpoint)
        state = json.loads((Path(resume_from_checkpoint) / STATE_FILE).read_text())
        self.controller.state = RankState(**state["controller"])
        self.controller.sync_open()  # closed entries came back as zeros
        self.controller.load_importance(state["importance"])
        self.history = state["history"]


def load_truncated_checkpoint(model, checkpoint: str) -> None:
    """Load a truncated training checkpoint into the model it was cut from: at full rank, or where
    the run had cut its ranks (``rank_cuts.py``) at the bond sizes it had then, so that AdamW's
    saved moments fit the parameters again."""
    state_path = Path(checkpoint) / STATE_FILE
    if not state_path.is_file():
        raise ComeraError(f"{checkpoint} has no {STATE_FILE}: it is not a `comera train` checkpoint")
    saved = json.loads(state_path.read_text())
    kept, bond_dims = saved["kept"], saved.get("bond_dims", {})
    tensors = load_file(str(Path(checkpoint) / "model.safetensors"))
    for up_name, name, up, down in pruned_pairs(model):
        if name in kept:
            bond = NeuronBond(up, down)
            bond.restore_(tensors, (up_name, name), kept[name][0], bond_dims.get(name, bond.bond_dims)[0])
    for name, module in model.named_modules():
        if name not in kept or not isinstance(module, TTModule):
            continue
        if name in bond_dims and tuple(bond_dims[name]) != module.bond_dims:
            module.resize_bonds_(bond_dims[name])
        prefix = f"{name}."
        cores = [tensors.pop(f"{prefix}cores.{k}") for k in range(len(module.cores))]
        gates = [tensors.pop(f"{prefix}gates.{k}") for k in range(len(module.gates))]
        module.expand_(cores, gates, kept[name])
    result = model.load_state_dict(with_current_names(tensors, model.state_dict().keys()), strict=False)
    if result.unexpected_keys:
        raise ComeraError(f"{checkpoint} holds tensors this model does not have: {result.unexpected_keys[:3]}")


# The names some transformers releases (5.1) write LayerNorm parameters under on save, and the ones
# the modules hold: a training checkpoint is read back with load_state_dict, not from_pretrained.
SAVED_NAMES = ((".gamma", ".weight"), (".beta", ".bias"))


def with_current_names(tensors: dict, model_keys) -> dict:
    """``tensors`` with every saved legacy name the model lacks renamed to the one it holds."""
    model_keys = set(model_keys)
    renamed = {}
    for key, tensor in tensors.items():
        for saved, held in SAVED_NAMES:
            if key not in model_keys and key.endswith(saved) and key[: -len(saved)] + held in model_keys:
                key = key[: -len(saved)] + held
        renamed[key] = tensor
    return renamed


class RankCallback(TrainerCallback):
    """Prunes gates after each optimizer step, switches the stage, and records the history."""

    def __init__(self, trainer: ComeraTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        history = self.trainer.history  # a resumed run's, restored before training begins
        self.trainer.clock.begin(history[-1].get("seconds", 0.0) if history else 0.0)

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer.grams is not None:  # a run that ended before its switch
            self.trainer.grams.remove()  # the trained model's forward passes record nothing more

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.controller.observe_gradients()

    def on_step_end(self, args, state, control, **kwargs):
        trainer, controller = self.trainer, self.trainer.controller
        controller.prune()
        if trainer.last_task_loss is not None and math.isfinite(trainer.last_task_loss):
            controller.schedule.observe_loss(trainer.last_task_loss)
        if controller.schedule.should_switch(state.global_step):
            controller.switch(state.global_step)
            logger.info("step %d: late stage, target size %d (now %d)", state.global_step,
                        controller.state.target_size, controller.state.size_at_switch)
            short = controller.schedule.short_late_stage(state.global_step, controller.ratio())
            if short:
                logger.warning(short)
        controller.enforce_budget(state.global_step)
        trainer.history.append({"step": state.global_step, "loss": trainer.last_task_loss,
                                "seconds": round(trainer.clock.elapsed(), 3), **controller.measurements()})
        trainer.cut_ranks_when_due(state.global_step)
        if trainer.clock.spent():
            control.should_training_stop = True  # --minutes: the time budget is spent

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs:
            controller = self.trainer.controller
            if controller.state.loss_ema is not None:
                logs["task_loss"] = round(controller.state.loss_ema, 4)  # "loss" is the staged objective
            logs["ratio"] = round(controller.ratio(), 3)
            logs["tt_size"] = controller.size()
            logs["stage"] = controller.state.stage


# One fused kernel steps every parameter (torch >= 2.4 on CPU, and on CUDA): a TT model has hundreds
# of small cores and gates, and a per-tensor step is bound by per-call overhead (fused AdamW over a
# bert-base-shaped TT model took a sixth of a per-tensor step's time on two cores).
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def fused_adamw_applies(groups: list[dict]) -> bool:
    """Whether torch's fused AdamW can step these parameter groups: all on one device of a kind it supports."""
    devices = {p.device for group in groups for p in group["params"]}
    return len(devices) == 1 and next(iter(devices)).type in FUSED_ADAMW_DEVICES


def distributed() -> bool:
    """Whether this process is one worker of several (torchrun)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
