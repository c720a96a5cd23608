"""train(): rank-adaptive continued pre-training of a compressed checkpoint, as `comera train` runs it.

    out/                    the trained model, truncated to its open ranks (a compressed checkpoint)
    out/checkpoints/        Trainer checkpoints (truncated too), for --resume
    out/comera_history.json loss, size and ratio per step
    out/training_curve.png  the same as a plot
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from ..conversion.calibration import max_positions
from ..conversion.report import describe, lineage, read_report
from ..conversion.storage import train_on_the_grid
from ..errors import ComeraError, ConfigError, ModelLoadError
from ..hf.compat import check_resume_support
from ..hf.config import compression_of, integer_format_of
from ..hf.gate_prices import serving_speed
from ..hf.files import write_text_atomic
from ..hf.loading import from_pretrained
from ..hf.saving import check_output_dir, save_compressed, shard_kwargs
from ..hf.sentence_config import sentence_embeddings
from ..models import load_model, load_tokenizer, read_config, resolve
from ..retrieval import held_out_pairs, model_retrieval
from ..text import Blocks, pack, shortened, text_length
from .attention import use_training_attention
from .fsdp import OPTIMIZER_FOLDER, Sharding, check_fsdp_possible, world_size
from .objectives import BlockCollator, pick_objective, require_same_depth, resolve_objective, task_for, task_loss
from .opening import fold_oversized
from .options import TrainOptions, schedule_mismatch
from .plan import TrainPlan, plan_training
from .plot import plot_history
from .rank_control import RankController
from .rank_cuts import step_times
from .speed_target import head_for_speed, speed_shortfall
from .trainer import STATE_FILE, ComeraTrainer, load_truncated_checkpoint, truncated_copy

logger = logging.getLogger("comera_convert.training")
CHECKPOINTS = "checkpoints"
# TrainOptions.lr_scheduler_type -> transformers' name; each starts with the linear warm-up.
SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
# The training set holds up to this many times the blocks the steps draw (python-stdlib: all of
# it), so that the draws spread over the corpus instead of its first documents, which distils to a
# higher held-out cosine (docs/findings.md).
READ_AHEAD = 4
# A ratio that moved less than this share kept the model's size: a loss that rose bought nothing.
SAME_SIZE = 0.005
# A run that closed ranks and keeps less than this share of the held-out retrieval it started with
# broke rather than traded quality for size: working --target-ratio runs kept 0.89 to 1.08 of
# their start, the broken ones 0.04 and 0.10.
KEPT_WHEN_BROKEN = 0.5


@dataclass
class TrainResult:
    out: Path
    objective: str
    steps: int
    ratio_before: float
    ratio_after: float
    held_out_before: float
    held_out_after: float
    ranks: dict = field(default_factory=dict)
    # Distilling an encoder: mean cosine of the student's and the teacher's sentence embeddings.
    cosine_before: float | None = None
    cosine_after: float | None = None
    # ... and the share of the teacher's retrieval recall@1 it keeps on held-out pairs (a passage's
    # first sentence against the rest of it), with how many pairs.
    task_before: float | None = None
    task_after: float | None = None
    task_pairs: int = 0
    report: object = None
    target_ratio: float | None = None
    # One line each: what --objective auto picked, and why a --target-ratio was missed (None: reached).
    objective_note: str | None = None
    shortfall: str | None = None
    # One line where a run that closed no rank ended on a higher held-out loss than it started from,
    # or one that closed ranks kept under KEPT_WHEN_BROKEN of its held-out retrieval; with the
    # report's key for it (held_out_loss_rose, held_out_retrieval_collapsed).
    regression: str | None = None
    regression_flag: str | None = None
    # The closed ranks cut out while training (rank_cuts.py): step, parameters stored before and after,
    # mean step seconds before and after.
    rank_cuts: list[dict] = field(default_factory=list)
    # Dense linears of the blocks opened to the gates for the target ratio (opening.py), by name.
    opened_layers: list[str] = field(default_factory=list)
    # --target-speedup: the speed against the dense model in the runtime, measured as the run started and on
    # the trained model (hf/gate_prices.ServingSpeed.to_dict()).
    target_speedup: float | None = None
    speed_before: dict | None = None
    speed_after: dict | None = None

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "report"}
        data["out"] = str(self.out)
        data["report"] = self.report.to_dict() if self.report is not None else None
        return data


def _compression(config: dict, name: str) -> dict:
    quantization = compression_of(config)
    if quantization is None:
        raise ConfigError(f"{name} is not a compressed model: convert it first with "
                          f"`comera convert {name} --ratio 4`, then train the result")
    return quantization


def _load_teacher(options: TrainPlan, quantization: dict, student):
    source = options.teacher or quantization.get("source")
    if not source:
        raise ConfigError("objective distill needs the dense teacher: the checkpoint records no source, "
                          "pass --teacher MODEL")
    teacher, _ = load_model(source, task="base")
    student_dim = student.config.hidden_size
    if getattr(teacher.config, "hidden_size", None) != student_dim:
        raise ConfigError(f"teacher {source} does not match the student: hidden size "
                          f"{getattr(teacher.config, 'hidden_size', '?')} vs {student_dim}")
    return teacher.eval().requires_grad_(False)


@contextlib.contextmanager
def evaluating(model):
    """The model in eval mode without autograd for the block, then back in its mode; yields its device."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield next(model.parameters()).device
    finally:
        model.train(was_training)


def held_out_loss(model, blocks, objective, collate, teacher, batch_size: int,
                  states: str = "relative-mse", pooled: str = "cosine") -> float:
    """The end-to-end objective on the held-out blocks (``states`` and ``pooled``: distillation's distances of
    a hidden state and of the pooled embeddings, so that the figure is the loss training lowers)."""
    if not blocks:
        return float("nan")
    losses = []
    with evaluating(model) as device:
        for start in range(0, len(blocks), batch_size):
            batch = collate([{"input_ids": b, "index": -1 - start - i}
                             for i, b in enumerate(blocks[start:start + batch_size])])
            batch = {k: v.to(device) for k, v in batch.items()}
            losses.append(float(task_loss(objective, model, batch, teacher, states=states, pooled=pooled)))
    return sum(losses) / len(losses)


def held_out_embeddings(model, blocks, batch_size: int) -> torch.Tensor:
    """The model's mean-pooled sentence embeddings of the held-out blocks, one row per block."""
    pooled = []
    with evaluating(model) as device:
        for start in range(0, len(blocks), batch_size):
            ids = torch.stack(blocks[start:start + batch_size]).to(device)
            pooled.append(sentence_embeddings(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
    return torch.cat(pooled)


def held_out_cosine(model, targets: torch.Tensor | None, blocks, batch_size: int) -> float | None:
    """Mean cosine between the model's held-out embeddings and ``targets`` (the teacher's, computed
    once): for a distilled encoder, the figure `comera eval` reports (here on packed blocks)."""
    if targets is None:
        return None
    embeddings = held_out_embeddings(model, blocks, batch_size)
    return float(torch.nn.functional.cosine_similarity(embeddings, targets, dim=-1).mean())


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Every dropout of the model drops with probability ``p`` (its config is left as it was): the
    nn.Dropout modules, and the float ``attention_dropout`` that Llama-style attention passes to
    its attention kernel instead of holding a module."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
        elif isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = p


def training_arguments(options: TrainPlan, output_dir: Path, **overrides):
    from transformers import TrainingArguments

    cuda = torch.cuda.is_available()
    bf16 = options.bf16 if options.bf16 is not None else default_bf16(cuda)
    kwargs = dict(
        output_dir=str(output_dir), max_steps=options.steps, per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.gradient_accumulation_steps, logging_steps=options.logging_steps,
        save_strategy="steps", save_steps=options.save_steps, seed=options.seed, bf16=bf16,
        use_cpu=not cuda, report_to=[], lr_scheduler_type=SCHEDULERS[options.lr_scheduler_type],
        warmup_steps=options.warmup_steps, remove_unused_columns=False,
        dataloader_drop_last=True,  # fixed shapes: CUDA graphs and torch.compile need them
        torch_compile=options.compile, torch_compile_mode="reduce-overhead" if options.compile else None,
        disable_tqdm=True, save_total_limit=2,
        **_checkpointing_arguments(TrainingArguments, options.gradient_checkpointing),
        **_grouping_arguments(TrainingArguments, options.varies_lengths),
        # Under torchrun on CPU, DDP and FSDP run over gloo (NCCL needs GPUs).
        ddp_backend="gloo" if not cuda and world_size() > 1 else None,
        # A model sharded before the Trainer saves its optimizer state itself (ComeraTrainer).
        save_only_model=options.fsdp,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX tiles). There bf16 autocast
    trains faster than float32, more steps in the same minutes (docs/findings.md); elsewhere bfloat16
    is emulated and slower than float32. A torch too old to ask (2.4 has neither probe) is taken as
    emulating: float32 is the safe default there."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def default_bf16(cuda: bool) -> bool:
    """bf16 autocast where it trains faster than float32: on CUDA, and on a CPU that multiplies
    bfloat16 natively (an emulating CPU took 43 steps of the MiniLM distillation recipe in six
    minutes where float32 took 398)."""
    return cuda or native_bf16_cpu()


def bf16_warning(options: TrainPlan, cuda: bool) -> str | None:
    """One line when bf16 is requested on a CPU that emulates it, else None."""
    if options.bf16 and not cuda and not native_bf16_cpu():
        return ("bf16 on this CPU is emulated (no AVX512-BF16 or AMX): float32 trains faster here, "
                "pass --no-bf16")
    return None


def _check_lengths(model, options: TrainPlan) -> None:
    """Refuse blocks longer than the model has positions for (a failure deep in its embeddings at
    the first step otherwise)."""
    longest = max(options.seq_len, options.start_max_tokens or 0)
    limit = max_positions(model)
    if limit is not None and longest > limit:
        flag = "--start-max-tokens" if longest > options.seq_len else "--seq-len"
        raise ConfigError(f"{flag} {longest} is longer than the {limit} positions the model takes: "
                          f"expected at most {limit}")


def _grouping_arguments(arguments_class, varied: bool) -> dict:
    """Batches of blocks of like lengths (transformers' length-grouped sampler), so that document
    starts cut short make short, cheap batches (and long ones long batches) instead of padding beside
    whole blocks; under the name this transformers takes (``group_by_length`` became
    ``train_sampling_strategy``)."""
    if not varied:
        return {}
    names = {f.name for f in fields(arguments_class)}
    if "train_sampling_strategy" in names:
        return {"train_sampling_strategy": "group_by_length"}
    return {"group_by_length": True}


def _checkpointing_arguments(arguments_class, enabled: bool) -> dict:
    """Activation checkpointing under the name this transformers takes (5.23 renamed
    ``gradient_checkpointing`` to ``activation_checkpointing`` and warns on the old one);
    non-reentrant, which also recomputes layers whose inputs need no gradient."""
    names = {f.name for f in fields(arguments_class)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {name: enabled, f"{name}_kwargs": {"use_reentrant": False} if enabled else None}


def last_checkpoint(directory: Path) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(directory)) if directory.is_dir() else None


@dataclass
class Session:
    """A training run's model and what it is judged by, once loaded and checked."""

    path: str
    objective: str
    objective_note: str | None
    options: TrainPlan  # the request planned for the objective
    model: torch.nn.Module
    tokenizer: object
    teacher: torch.nn.Module | None
    controller: RankController
    encoder: bool  # distilling a sentence encoder: held-out embedding cosines too
    source: str | None = None  # the dense model the checkpoint records it was converted from


def recorded_layers_cut(path, target_ratio: float | None = None) -> float | None:
    """How hard the conversion cut the checkpoint's factorized layers, as its report records it (None
    where it records none, or where the report is unreadable: export says so as it starts a new one).
    With a target ratio, how hard the target ratio cuts them at least: the recorded cut times the target ratio
    over the ratio now (more where layers the gates cannot shrink, such as a codebook table, hold
    part of the model)."""
    try:
        report = read_report(path)
    except ModelLoadError:
        return None
    cut = report.extra.get("layers_cut") if report is not None else None
    if not isinstance(cut, (int, float)):
        return None
    if target_ratio is not None and report.ratio:
        return float(cut) * max(1.0, target_ratio / report.ratio)
    return float(cut)


def open_session(model_name: str, options: TrainOptions) -> Session:
    """Load the compressed model, its tokenizer and (distilling) its teacher; resolve the objective
    and the options it implies; set up the rank controller. Every refusal happens here, before data."""
    from transformers import set_seed

    path = resolve(model_name)
    config = read_config(path)
    quantization = _compression(config, model_name)
    objective, note, options, encoder = _resolved_options(path, config, quantization, options)
    # Parameters the checkpoint lacks (a head or pooler the task adds) are initialized at random as
    # the model loads: seeded, so that a run is repeatable and every worker starts from the same
    # model (FSDP shards each worker's own values; DDP would broadcast the main one's).
    set_seed(options.seed)
    model = _student(path, objective, options)
    tokenizer = load_tokenizer(path, "comera train")
    teacher = _load_teacher(options, quantization, model) if objective == "distill" else None
    if options.distill_mode == "block-wise":
        require_same_depth(model, teacher)
    dense_params = quantization.get("dense_params") or sum(p.numel() for p in model.parameters())
    return Session(path, objective, note, options, model, tokenizer, teacher,
                   RankController(model, options, dense_params), encoder, quantization.get("source"))


def _resolved_options(path: str, config: dict, quantization: dict, options: TrainOptions):
    """(objective, note, options for it, whether a distilled encoder): the objective picked from the
    checkpoint, and the plan of the options it implies (``plan_training``)."""
    objective, note = pick_objective(options.objective, config, options.teacher or quantization.get("source"))
    encoder = objective == "distill" and resolve_objective("auto", config) == "mlm"
    for flag, value in (("--distill-mode", options.distill_mode != "end-to-end" and options.distill_mode),
                        ("--distill-states", options.distill_states == "cosine" and options.distill_states)):
        if value and objective != "distill":
            raise ConfigError(f"{flag} {value} needs the distill objective; this run trains with {objective}")
    # Integer factors (the config's storage record) keep the relative MSE: each token's cosine ended
    # level with it on an int4 checkpoint (docs/findings.md).
    cut = None if quantization.get("storage") else recorded_layers_cut(path, options.target_ratio)
    by_cut = objective == "distill" and options.distill_states is None and cut is not None
    options = plan_training(options, objective, encoder, cut)
    if by_cut:
        how = "the target ratio cuts the factorized layers at least" if options.target_ratio else \
            "the conversion cut the factorized layers"
        note = "; ".join(filter(None, [note, f"hidden states matched by {options.distill_states} ({how} {cut:.1f}x; "
                                              "--distill-states to choose)"]))
    return objective, note, options, encoder


def _student(path: str, objective: str, options: TrainPlan) -> torch.nn.Module:
    """The compressed model as it trains: its head for the objective, its dropout, and (integer factors) on
    its grid."""
    model = from_pretrained(path, task=task_for(objective))
    if options.gradient_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"--gradient-checkpointing: {type(model).__name__} does not support activation "
                          "checkpointing in transformers; train without it")
    if options.dropout is not None:
        set_dropout(model, options.dropout)
    # An integer checkpoint trains on its rounded factors (quantization-aware) and is written on the
    # same grid: its scales by each group's largest magnitude, as the forward passes rounded.
    grid = integer_format_of(model)
    if grid is not None:
        model.config.quantization_config.round_as_trained()
        train_on_the_grid(model, grid)
    return model


# Held-out pairs a distilled encoder's retrieval is scored on, before and after training: enough
# for a stable recall@1, few enough to embed in seconds on a CPU.
TASK_PAIRS = 256


@dataclass
class HeldOut:
    """The held-out blocks and how the model is measured on them: the task loss and, for a
    distilled encoder, the cosine of its embeddings to the teacher's (computed once)."""

    session: Session
    blocks: list
    collate: BlockCollator
    targets: torch.Tensor | None = None
    pairs: list = field(default_factory=list)
    teacher_task: dict | None = None

    def __post_init__(self):
        s = self.session
        if s.encoder and self.blocks:
            self.targets = held_out_embeddings(s.teacher, self.blocks, s.options.batch_size)
        if s.encoder:
            self.pairs = held_out_pairs(s.options.data, TASK_PAIRS)
            if len(self.pairs) >= 2:
                self.teacher_task = model_retrieval(s.teacher, s.tokenizer, self.pairs, s.options.seq_len)

    def measure(self) -> tuple[float, float | None, float | None]:
        s = self.session
        loss = held_out_loss(s.model, self.blocks, s.objective, self.collate, s.teacher, s.options.batch_size,
                             s.options.distill_states, s.options.distill_pooled)
        task = None
        if self.teacher_task and self.teacher_task["recall_at_1"]:
            with evaluating(s.model):
                task = (model_retrieval(s.model, s.tokenizer, self.pairs, s.options.seq_len)["recall_at_1"]
                        / self.teacher_task["recall_at_1"])
        return loss, held_out_cosine(s.model, self.targets, self.blocks, s.options.batch_size), task


def train(model_name: str, options: TrainOptions, out, *, resume: bool = False, overwrite: bool = False,
          callbacks=(), training_overrides=None, command: str | None = None,
          max_shard_size: int | str | None = None) -> TrainResult:
    """Continue pre-training the compressed ``model_name`` while CoMERA adapts its ranks; write the
    result to ``out`` (`comera train`)."""
    out = Path(out)
    shard_kwargs(max_shard_size)  # a size that cannot work fails now, not after training
    if options.fsdp:
        check_fsdp_possible()
    if not resume:
        check_output_dir(out, overwrite)
    session = open_session(model_name, options)
    options = session.options
    speed = head_for_speed(session) if options.target_speedup is not None else None
    ratio_before = session.controller.ratio()
    drawn = options.steps * options.batch_size * options.gradient_accumulation_steps
    blocks = pack(options.data, session.tokenizer, options.seq_len, drawn * READ_AHEAD, options.max_eval_blocks,
                  start_len=options.start_max_tokens)
    _check_lengths(session.model, options)
    collate = BlockCollator(session.objective, session.tokenizer, options.mlm_probability, options.seed)
    resume_from = _resume_point(out / CHECKPOINTS, resume, options)
    args = training_arguments(options, out / CHECKPOINTS, **(training_overrides or {}))
    session.model.to(args.device)
    if session.teacher is not None:
        session.teacher.to(args.device)
    cuda = args.device.type == "cuda"
    use_training_attention((session.model, session.teacher), cuda, args.bf16)
    held_out = HeldOut(session, blocks.held_out, collate)
    before = held_out.measure()
    sharding = _shard(session, resume_from) if options.fsdp else None
    trainer = _trainer(session, args, blocks, collate, callbacks, sharding)
    if session.objective_note:
        logger.info(session.objective_note)  # once everything is in place, so that it never precedes an error
    if warning := bf16_warning(options, cuda):
        logger.warning(warning)
    trainer.train(resume_from_checkpoint=resume_from)
    session.controller.prune()
    check_replicas_agree(session.controller)
    after = held_out.measure()
    result = _result(out, session, trainer.state.global_step, ratio_before, before, after, len(held_out.pairs))
    result.rank_cuts = step_times(trainer.history, session.controller.state.cuts)
    if speed is not None:
        _measure_speed(result, session, speed)
    for warning in (result.shortfall, result.regression):
        if warning:
            logger.warning(warning)
    _write(result, trainer, session, sharding, out, held_out.targets is not None, command, max_shard_size)
    return result


def _measure_speed(result: TrainResult, session: Session, speed) -> None:
    """The trained model, truncated to its open ranks as it is written, timed against the dense model in the
    runtime; a speed short of --target-speedup is the run's shortfall."""
    goal, start, dense = speed
    truncated, _ = truncated_copy(session.model, fold=True)
    # The class's own forward: for bf16 training Trainer's accelerate set an instance forward in autocast (its
    # ``_original_forward`` kept beside it), and the graphs are checked against the float32 model.
    for wrapped in ("forward", "_original_forward"):
        truncated.__dict__.pop(wrapped, None)
    fold_oversized(truncated, list(session.controller.opened))
    with torch.no_grad():
        reached = serving_speed(truncated.cpu().eval(), dense.cpu(), session.tokenizer, goal.runtime)
    result.target_speedup, result.speed_before, result.speed_after = (goal.target_speedup, start.to_dict(),
                                                                      reached.to_dict())
    result.shortfall = speed_shortfall(reached, goal.target_speedup) or result.shortfall
    logger.info("measured in %s: %.2fx the dense model's speed (target %gx), ratio %.2fx", goal.runtime,
                reached.speedup, goal.target_speedup, result.ratio_after)


def _write(result: TrainResult, trainer, session: Session, sharding, out: Path, distilled: bool, command,
           max_shard_size) -> None:
    """The trained model exported by the main worker, every worker waiting until it is written."""
    trained = session.model if sharding is None else sharding.full_model(session.model)
    if trainer.is_world_process_zero():
        result.report = export(trained, trainer.history, out, source=session.path,
                               training=_record(result, session.options, distilled), command=command,
                               max_shard_size=max_shard_size)
        result.ratio_after = result.report.ratio  # more than the run's own count where opened layers went dense again
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every worker returns once the trained model is written


def _resume_point(checkpoints: Path, resume: bool, options: TrainPlan) -> str | None:
    fsdp = options.fsdp
    resume_from = last_checkpoint(checkpoints) if resume else None
    if resume and resume_from is None:
        raise ConfigError(f"--resume: {checkpoints} holds no checkpoint to resume from")
    sharded = resume_from is not None and (Path(resume_from) / OPTIMIZER_FOLDER).is_dir()
    if resume_from is not None and sharded != fsdp:
        held = "sharded across workers (--fsdp)" if sharded else "whole (a run without --fsdp)"
        raise ConfigError(f"--resume: {resume_from} holds its optimizer state {held}: resume it "
                          f"{'with' if sharded else 'without'} --fsdp")
    if resume_from is not None:
        check_resume_support()
        _check_resumed_schedule(resume_from, options)
    return resume_from


def _check_resumed_schedule(checkpoint: str, options: TrainPlan) -> None:
    """Refuse to resume ``checkpoint`` on another rank schedule than it was trained on; a checkpoint
    of a release that recorded none is resumed on the command's, with a warning."""
    state_path = Path(checkpoint) / STATE_FILE
    if not state_path.is_file():
        return  # not a `comera train` checkpoint: loading it says so (load_truncated_checkpoint)
    saved = json.loads(state_path.read_text()).get("schedule")
    if saved is None:
        logger.warning("--resume: %s records no rank schedule (saved by an earlier release): it continues on "
                       "this command's settings", checkpoint)
    elif mismatch := schedule_mismatch(saved, options):
        raise ConfigError(f"--resume: {checkpoint} {mismatch}: resume it with the settings it was trained with")


def _shard(session: Session, resume_from: str | None):
    """Shard the model across the workers (--fsdp); a resumed run's checkpoint is loaded first,
    into the whole model."""
    if resume_from is not None:
        load_truncated_checkpoint(session.model, resume_from)
    return Sharding(session.model)


def _trainer(session: Session, args, blocks: Blocks, collate, callbacks, sharding=None) -> ComeraTrainer:
    from transformers.trainer_callback import PrinterCallback

    options = session.options
    drawn = with_document_starts(blocks, options.document_starts, options.start_min_tokens, options.seed)
    dataset = [{"input_ids": block, "index": i} for i, block in enumerate(drawn)]
    trainer = ComeraTrainer(model=session.model, args=args, train_dataset=dataset, data_collator=collate,
                            processing_class=session.tokenizer, comera_options=session.options,
                            controller=session.controller, objective=session.objective, teacher=session.teacher,
                            sharding=sharding, callbacks=list(callbacks))
    # The caller's callbacks show progress (the CLI's rich bar) and the history JSON keeps every
    # step, so transformers' printer of raw log dicts stays out of the output.
    trainer.remove_callback(PrinterCallback)
    return trainer


def _result(out: Path, session: Session, steps: int, ratio_before: float, before, after,
            pairs: int = 0) -> TrainResult:
    controller = session.controller
    ratio_after = controller.ratio()
    flag, line = (regression(before[0], after[0], ratio_before, ratio_after, session.options.lr_cores)
                  or collapse(before[2], after[2], ratio_before, ratio_after) or (None, None))
    return TrainResult(out=out, objective=session.objective, steps=steps, ratio_before=ratio_before,
                       ratio_after=ratio_after, held_out_before=before[0], held_out_after=after[0],
                       ranks=controller.ranks(), cosine_before=before[1], cosine_after=after[1],
                       task_before=before[2], task_after=after[2], task_pairs=pairs if before[2] is not None else 0,
                       target_ratio=session.options.target_ratio, objective_note=session.objective_note,
                       shortfall=controller.shortfall(steps), opened_layers=list(controller.opened),
                       regression=line, regression_flag=flag)


def _shrank(ratio_before: float, ratio_after: float) -> bool:
    return ratio_after > ratio_before * (1 + SAME_SIZE)


def regression(before: float, after: float, ratio_before: float, ratio_after: float,
               lr_cores: float) -> tuple[str, str] | None:
    """The report's flag and one line where a run that shrank nothing ends on a higher held-out loss
    than it started from (nothing was traded for it: the model written keeps less than its start),
    with the usual cause; None where the loss fell, or where ranks closed and the loss paid for the size."""
    if _shrank(ratio_before, ratio_after) or not (after > before or math.isnan(after)):
        return None
    return "held_out_loss_rose", (
        f"training raised the held-out loss ({before:.4f} -> {after:.4f}) and kept the size: the model "
        f"written likely keeps less than the one it started from; a smaller --lr-cores (this run: "
        f"{lr_cores:g}) usually steadies it")


def collapse(kept_before: float | None, kept_after: float | None, ratio_before: float,
             ratio_after: float) -> tuple[str, str] | None:
    """The report's flag and one line where a run that closed ranks ends keeping less than
    KEPT_WHEN_BROKEN of the held-out retrieval it started with (shares of the teacher's recall@1);
    None where it kept more, closed nothing, or measured no retrieval."""
    if kept_before is None or kept_after is None or not _shrank(ratio_before, ratio_after):
        return None
    if kept_after >= KEPT_WHEN_BROKEN * kept_before:
        return None
    return "held_out_retrieval_collapsed", (
        f"the run reached {ratio_after:.2f}x but its held-out retrieval fell from {kept_before:.3f} to "
        f"{kept_after:.3f} of the teacher's: the model written likely broke rather than traded quality for "
        f"size; a smaller --lr-cores or a later stage switch (--early-steps) usually steadies it")


def _record(result: TrainResult, options: TrainPlan, cosines: bool) -> dict:
    """What the report keeps of the run."""
    record = {"objective": result.objective, "steps": result.steps,
              "held_out_loss_before": result.held_out_before, "held_out_loss_after": result.held_out_after}
    if options.target_ratio is not None:
        record.update(target_ratio=options.target_ratio, ratio_reached=result.ratio_after,
                      target_reached=result.shortfall is None)
    if result.target_speedup is not None:
        record.update(target_speedup=result.target_speedup, speed_before=result.speed_before,
                      speed_reached=result.speed_after, ratio_reached=result.ratio_after,
                      target_reached=result.shortfall is None)
    if result.regression_flag:
        record[result.regression_flag] = True
    if result.rank_cuts:
        record.update(rank_cuts=result.rank_cuts)
    if result.opened_layers:
        record.update(opened_layers=result.opened_layers)
    if cosines:
        record.update(held_out_cosine_before=result.cosine_before, held_out_cosine_after=result.cosine_after)
    if result.task_pairs:
        record.update(held_out_recall_kept_before=result.task_before, held_out_recall_kept_after=result.task_after,
                      held_out_pairs=result.task_pairs)
    return {**record, "options": options.to_dict(), "plan": options.describe()}


def with_document_starts(blocks: Blocks, share: float, min_tokens: int | None = None,
                         seed: int = 0) -> list[torch.Tensor]:
    """The packed training blocks, plus the documents' first blocks repeated so that they make up
    ``share`` of the list (the Trainer draws uniformly from it); with ``min_tokens`` each copy is
    cut to its first k tokens of text, k log-uniform between ``min_tokens`` and the whole block."""
    if not share or not blocks.starts:
        return blocks.train
    copies = max(1, round(share / (1 - share) * len(blocks.train) / len(blocks.starts)))
    starts = blocks.starts * copies
    if min_tokens is not None:
        draw = random.Random(seed)  # the same cuts on every run of a seed, so that --resume agrees
        wrapped = blocks.wrapped
        starts = [shortened(block, _log_uniform(draw, min_tokens, text_length(block, wrapped)), wrapped)
                  for block in starts]
    return blocks.train + starts


def _log_uniform(draw: random.Random, low: int, high: int) -> int:
    low = min(low, high)
    return round(math.exp(draw.uniform(math.log(low), math.log(high))))


def export(model, history: list[dict], out: Path, source: str, training: dict, command: str | None = None,
           max_shard_size: int | str | None = None):
    """Write the trained model truncated to its open ranks, its history and its curve, with every
    non-weight file of ``source`` and the lineage of its report; return the report."""
    truncated, _ = truncated_copy(model, fold=True)
    if saved_dense := fold_oversized(truncated, training.get("opened_layers", [])):
        training = {**training, "opened_layers_saved_dense": saved_dense}
    try:
        previous = read_report(source)
    except ModelLoadError as err:  # never lose a finished run over the input's bookkeeping
        logger.warning("%s; the new report starts afresh", err)
        previous = None
    report = describe(truncated, extra={**lineage(previous, command), "training": training})
    save_compressed(truncated, out, report=report, source=source, overwrite=True, **shard_kwargs(max_shard_size))
    write_text_atomic(out / "comera_history.json", json.dumps(history, indent=1))
    plot_history(history, out / "training_curve.png")
    return report


def leave_process_group() -> None:
    """Take down the process group of a torchrun run (accelerate sets it up and leaves it), as the
    process that owns it is done: a worker that exits with it still up may abort in gloo's threads
    ("terminate called without an active exception")."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def check_replicas_agree(controller: RankController) -> None:
    """Under DDP every worker must end with the same open ranks; say so loudly if not."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    mine = controller.ranks()
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    if any(other != mine for other in everyone):
        raise ComeraError("the workers disagree on the pruned ranks: gates diverged across DDP replicas")
