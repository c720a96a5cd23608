"""TrainOptions: every constant of CoMERA's rank-adaptive training, validated (what recipes hold).

Defaults are CoMERA's (NeurIPS 2024, Sec. 3 and Appendix): AdamW with learning rates 1e-4 for
the TT cores, 1e-3 for the rank gates and 5e-5 for the dense rest; beta = 0.01; pruning
threshold tau = 1e-2; early stage for two thirds of training (20 of 30 epochs), late stage
aiming at 0.2 of the model size at the switch. With a target ratio the late stage starts early,
trains on the task loss and closes ranks by a budget (TARGET_DEFAULTS: measured to keep more).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..choices import (DISTILL_MODES, DISTILL_POOLED, DISTILL_STATES, LATE_OBJECTIVES, LR_SCHEDULERS, OBJECTIVES,
                       REPROJECT_AT, SPEED_RUNTIMES)
from ..errors import ConfigError, expected
from ..option_files import from_mapping, option
from .budget import SCHEDULE_SHARE

# Where the conversion cut the factorized layers at least this much (its report's layers_cut),
# distillation matches each state's direction by default: better on MiniLM at --ratio 6 and 8, worse
# at --ratio 4. docs/findings.md
COSINE_STATES_FROM_CUT = 3.0
# The options left unset (None) take these by objective. Pre-training (mlm, clm) keeps CoMERA's
# rates. Distillation starts far from its optimum and matches an eval-mode teacher, so it trains the
# cores faster, without dropout, ends on a decayed rate and (an encoder) sees its documents' first
# blocks; without a --target-ratio it keeps the size (no late stage, no size term), where CoMERA's
# late stage would spend a third of the run shrinking gates instead of matching the teacher. Each
# was measured in the train-minilm-distill recipe: BENCHMARKS.md#quality-beside-the-peers
PRETRAINING_DEFAULTS = dict(lr_cores=1e-4, lr_rest=5e-5, warmup_steps=0, lr_scheduler_type="constant",
                            document_starts=0.0, beta=0.01)
DISTILL_DEFAULTS = dict(lr_cores=1e-3, lr_rest=1e-4, dropout=0.0, lr_scheduler_type="cosine",
                        document_starts=0.5, beta=0.0)
DISTILL_WARMUP = 50  # steps, at most a tenth of the run
# With a target ratio the late stage starts after this share of the run, trains on the task loss and
# closes the ranks over its first budget.SCHEDULE_SHARE, the pairs re-projected at the switch: kept more
# than CoMERA's schedule at equal compute (docs/findings.md).
TARGET_EARLY_SHARE = 0.05
TARGET_DEFAULTS = dict(late_objective="task", budget_share=SCHEDULE_SHARE)
DEFAULT_SPEED_RUNTIME = "openvino"  # where a --target-speedup is measured without --runtime: the fastest route here


# The settings that shape the rank schedule: a checkpoint records them resolved, and --resume refuses a
# command that resolves them otherwise (a default changed since, or a flag left off), which would
# continue the run on a schedule it did not start on.
SCHEDULE_FIELDS = ("target_ratio", "target_speedup", "runtime", "target_fraction", "early_steps", "budget_share",
                   "late_objective", "last_block_floor", "reproject", "reproject_at", "cut_ranks", "rank_multiple",
                   "tau")


# Settings that only a recipe holds (no flag of `comera train`): none now, every one is a flag.
RECIPE_ONLY = ()


def as_flag(name: str, value) -> str:
    """``value`` of option ``name`` as the command line gives it (``--budget-share 0.15``,
    ``--no-reproject``; ``no --target-ratio`` where it is unset), or a recipe (``target_fraction: 0.2``)."""
    if name in RECIPE_ONLY:
        return f"{name}: {value:g} (a recipe's)"
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    if value is None:
        return f"no {flag}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def schedule_mismatch(saved: dict, options: "TrainOptions") -> str | None:
    """The settings of ``SCHEDULE_FIELDS`` where ``saved`` (a checkpoint's) and ``options`` differ, as
    "was trained with ..., this command gives ..."; None where they agree."""
    differ = [name for name in SCHEDULE_FIELDS if name in saved and saved[name] != getattr(options, name)]
    if not differ:
        return None
    trained = " ".join(as_flag(name, saved[name]) for name in differ)
    given = " ".join(as_flag(name, getattr(options, name)) for name in differ)
    return f"was trained with {trained}, this command gives {given}"


def default_distill_states(layers_cut: float | None) -> str:
    """How distillation matches a hidden state by default: by direction ("cosine") where the
    factorized layers were cut COSINE_STATES_FROM_CUT or more, else by relative squared error (also
    where the checkpoint records no cut: one converted before the cut was recorded, or at a --rank)."""
    return "cosine" if layers_cut is not None and layers_cut >= COSINE_STATES_FROM_CUT else "relative-mse"


def _check_nonzero_share(name: str, value) -> None:
    """A share that cannot be zero: a number in (0, 1] (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(expected(f"{name} in (0, 1]", value))


def _check_share(name: str, value) -> None:
    """A probability or fraction: a number in [0, 1) (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(expected(f"{name} in [0, 1)", value))


@dataclass
class TrainOptions:
    """Every option of ``comera train``, validated on construction (what training recipes hold).

    Defaults are CoMERA's for pre-training (mlm, clm); options left ``None`` take the distillation recipe's
    measured settings when distilling. Out-of-range values raise ``ConfigError``."""

    CONCERNS = ("run", "optimizer", "stages", "target ratio", "speed target", "distillation", "hardware")
    objective: str = option("auto", "run", "Task loss [default: auto].", choices=OBJECTIVES)
    # Natural English of several genres (the built-in corpus); python-stdlib for code models.
    data: str = option(
        "english", "run",
        "Text file, directory, JSONL, dataset name, or a built-in corpus: english [default], "
        "python-stdlib, english+python-stdlib (both, for distillation).")
    steps: int = option(1000, "run", "Optimizer steps [default: 1000].", flag=("--max-steps", "--steps"), type=int)
    # A wall-time budget in minutes: training stops when it is spent or at `steps`, whichever comes
    # first, and the learning-rate schedule runs over the first of the two (training/wall_clock.py).
    minutes: float | None = option(
        None, "run",
        "Wall-time budget: stop when it is spent or at --steps, whichever comes first; the learning rate "
        "decays over the first of the two.", type=float)
    seq_len: int = option(128, "run", "Tokens per packed block [default: 128].", type=int)
    # per device, as TrainingArguments' per_device_train_batch_size
    batch_size: int = option(
        8, "run",
        "Blocks per step and device [default: 8].", flag=("--per-device-train-batch-size", "--batch-size"), type=int)
    gradient_accumulation_steps: int = option(
        1, "run",
        "Steps whose gradients add up before each optimizer step [default: 1].", type=int)
    # CoMERA's three AdamW learning rates (None: by objective, PRETRAINING_DEFAULTS / DISTILL_DEFAULTS):
    # the compressed layers' factors (TT cores, pruned layers' weights), the rank gates, the rest.
    lr_cores: float | None = option(
        None, "optimizer",
        "AdamW rate of the compressed layers' factors: TT cores and pruned layers' weights [default: "
        "1e-4; 1e-3 to distill].", type=float)
    lr_gates: float = option(1e-3, "optimizer", "AdamW rate of the rank gates [default: 1e-3].", type=float)
    lr_rest: float | None = option(
        None, "optimizer",
        "AdamW rate of dense parameters [default: 5e-5; 1e-4 to distill].", type=float)
    # cores and dense rest; gates have none (their size term is the regularizer)
    weight_decay: float = option(
        0.01, "optimizer",
        "AdamW's weight decay on the cores and the dense rest; the gates have none [default: 0.01].",
        type=float, metavar="X")
    # None: 0, or up to 50 to distill
    warmup_steps: int | None = option(
        None, "optimizer",
        "Steps of linear learning-rate warm-up [default: 0; up to 50, a tenth of the run, to distill].", type=int)
    # None: constant (CoMERA), cosine to distill
    lr_scheduler_type: str | None = option(
        None, "optimizer",
        "Learning rates after the warm-up: held (CoMERA) or decayed to 0 [default: constant; cosine to "
        "distill].", choices=LR_SCHEDULERS)
    # Early stage: L + beta * mean(|active gates|). None: 0.01 (CoMERA), 0 to distill without a target ratio.
    beta: float | None = option(None, "stages", "Weight of the rank term, early stage [default: 0.01].", type=float)
    # A gate entry below tau is pruned for good (CoMERA's 1e-2).
    tau: float = option(1e-2, "stages", "Gate pruning threshold [default: 1e-2].", type=float)
    # Prune in whole multiples: a bond closes entries only as many at a time as keep its open
    # count a multiple of this (the weakest of those below tau first). 8 keeps bf16 GEMMs on
    # tensor-core shapes, as `comera convert --rank-multiple 8` does. 1 prunes entry by entry (CoMERA).
    rank_multiple: int = option(
        1, "stages",
        "Prune so that open ranks stay multiples of this, e.g. 8 for bf16 GPUs [default: 1].", type=int)
    # Steps of the early stage; None = two thirds of `steps` (CoMERA: 20 of 30 epochs), TARGET_EARLY_SHARE
    # of them with a target ratio, or all of them to distill without one.
    early_steps: int | None = option(
        None, "stages",
        "Steps of the early stage [default: 2/3 of steps, 5 % with --target-ratio].", type=int)
    # Also switch early when the loss stops improving: relative EMA gain below plateau_tol over
    # plateau_window steps. 0 disables the plateau test.
    plateau_window: int = option(
        0, "stages",
        "Also switch stages once the loss's smoothed gain over N steps falls below --plateau-tol "
        "[default: 0, off].", type=int, metavar="N")
    plateau_tol: float = option(
        1e-3, "stages",
        "The relative gain under which --plateau-window switches stages [default: 1e-3].", type=float, metavar="X")
    # Late stage target size: --target-ratio (whole model, vs the dense source) or, if unset,
    # target_fraction of the TT size at the switch (CoMERA: 0.2).
    target_ratio: float | None = option(
        None, "target ratio",
        "Whole-model ratio to reach by the end: ranks close by importance over the late stage (scheduled "
        "in steps, or with --minutes in the time spent).", type=float)
    # Late stage target speed: the model served in --runtime this many times as fast as its dense source served
    # there in its fastest form on this machine (hf/gate_prices.py). One budget with --target-ratio's: its
    # units are microseconds a batch instead of parameters, each gate entry priced by its measured time.
    target_speedup: float | None = option(
        None, "speed target",
        "Speed to reach by the end, against the dense model served in --runtime in its fastest form on this "
        "machine: ranks and neurons close by importance per microsecond they cost, measured here.", type=float,
        metavar="S")
    runtime: str | None = option(
        None, "speed target",
        "Where --target-speedup is measured: OpenVINO, ONNX Runtime or torch [default: openvino].",
        choices=SPEED_RUNTIMES)
    target_fraction: float = option(
        0.2, "stages",
        "Without --target-ratio: the late stage's size target as this share of the TT size at the switch "
        "(CoMERA's) [default: 0.2].", type=float, metavar="X")
    # Share of the late stage over which a --target-ratio budget falls to the target ratio; the rest trains
    # at the final ranks. None: budget.SCHEDULE_SHARE under a target ratio (the training plan sets it).
    budget_share: float | None = option(
        None, "target ratio",
        "Share of the late stage over which --target-ratio closes ranks; the rest trains at the final "
        "ranks [default: 0.15].", type=float)
    # The fewest entries each bond of the stack's last block keeps under a --target-ratio budget, as a
    # share of its rank as training starts (every other bond keeps a quarter, budget.MIN_KEPT_SHARE).
    # The conversion gives the last block twice the others' rank (--last-block-rank-scale): its error
    # reaches the output with no later layer to compensate it. None: a quarter, as every bond.
    last_block_floor: float | None = option(
        None, "target ratio",
        "Share of its rank at the start that each bond of the last block keeps under --target-ratio "
        "[default: 0.25, as every bond].", type=float)
    # Late stage target loss L0; None = the (smoothed) loss at the switch.
    target_loss: float | None = option(
        None, "stages",
        "The late stage's loss target L0 [default: the smoothed loss at the switch].", type=float, metavar="L")
    # The late stage's loss with a --target-ratio budget (choices.LATE_OBJECTIVES). min-max (CoMERA's)
    # steps on the rank surrogate whenever the task loss is below L0, which holds the task loss near
    # the switch's while the budget already sets the size; task trains on the task loss (+ beta * R).
    # None: TARGET_DEFAULTS's under a target ratio (without one the late stage is the min-max).
    late_objective: str | None = option(
        None, "target ratio",
        "The late stage's loss under --target-ratio: CoMERA's min-max of task loss and rank surrogate, or "
        "the task loss alone (the budget sets the size) [default: task].", choices=LATE_OBJECTIVES)
    # Weight of the weighted-sum term L + beta * R added to the min-max step in the late stage.
    late_weighted_sum: float = option(
        0.1, "stages",
        "Weight of the weighted-sum term (loss + beta * rank surrogate) added to the late stage's min-max "
        "step [default: 0.1].", type=float, metavar="X")
    # Weight of the rank surrogate when size is the worse-off objective in the late stage.
    late_rank_weight: float = option(
        1.0, "stages",
        "Weight of the rank surrogate when size is the worse-off objective of the late stage [default: "
        "1].", type=float, metavar="X")
    mlm_probability: float = option(
        0.15, "run",
        "Share of tokens masked for the mlm objective [default: 0.15].", type=float, metavar="P")
    # Share of the training draws that are a training document's first block ([CLS] and the text
    # from its start, as a sentence encoder embeds it); the rest are packed blocks that start
    # anywhere. 0 (packed blocks only) is pre-training's usual; distilling a sentence encoder
    # gains from matching how its texts begin (the train-minilm-distill recipe: 0.5). None: by objective.
    document_starts: float | None = option(
        None, "distillation",
        "Share of training draws that are a document's first block [default: 0, packed blocks only; 0.5 "
        "to distill a sentence encoder].", type=float)
    # Cut each drawn document start to its first k tokens of text, k drawn log-uniformly between
    # this and the block's text length (a fixed draw per copy), so that the student also matches
    # the teacher on texts as short as those a sentence encoder embeds (queries of 5 to 20 tokens,
    # descriptions of 20 to 120). None: every start is a whole block.
    start_min_tokens: int | None = option(
        None, "distillation",
        "Cut each drawn document start to its first k tokens, k log-uniform from this to the block's "
        "length (short texts, as an encoder embeds them) [default: whole blocks].", type=int)
    # Keep each drawn document start up to this many tokens (as long as the document runs) where
    # the packed blocks hold seq_len: a sentence encoder embeds texts up to 256 tokens, and a
    # student trained on 128-token blocks alone drifts on the tokens past them. None: seq_len.
    start_max_tokens: int | None = option(
        None, "distillation",
        "Keep document starts up to this many tokens, past --seq-len (long texts, as an encoder embeds "
        "them up to 256) [default: --seq-len].", type=int)
    # Every dropout probability of the model while it trains (its nn.Dropout modules, which BERT's
    # and GPT-2's attention also read, and Llama-style attention's float attention_dropout); None
    # keeps the model's own (0 to distill). The saved config keeps its own.
    dropout: float | None = option(
        None, "optimizer",
        "Every dropout probability while training [default: the model's; 0 to distill].", type=float)
    # Activation checkpointing (transformers' gradient checkpointing, layer by layer): each layer's
    # activations are recomputed in backward instead of kept. Less memory, about a third more compute.
    gradient_checkpointing: bool = option(
        False, "hardware",
        "Recompute each layer's activations in backward: less memory, more compute.", flag_value=True)
    teacher: str | None = option(None, "distillation", "Dense teacher for distill [default: the recorded source].")
    distill_mode: str = option(
        "end-to-end", "distillation",
        "Feed each student block the student's own states (end-to-end) or the teacher's (block-wise: each "
        "block learns its own map) [default: end-to-end].", choices=DISTILL_MODES)
    # The distance of each hidden state to the teacher's: "relative-mse", the squared error relative
    # to the teacher's, which a BERT's few largest hidden dimensions rule, or "cosine", each token's
    # cosine distance, the state's direction that mean pooling reads. None: by the conversion's cut
    # (``default_distill_states``).
    distill_states: str | None = option(
        None, "distillation",
        "Match each hidden state by its squared error relative to the teacher's, or by each token's "
        "cosine distance [default: cosine where the conversion cut the float factorized layers 3x or "
        "more, else relative-mse].", choices=DISTILL_STATES)
    # How the pooled sentence embeddings are matched: "cosine", each text's embedding against the teacher's;
    # "relational" adds the batch's similarity structure (which text each text is nearest, as retrieval
    # ranks them), "contrastive" a cross-entropy at picking its own text's teacher embedding.
    distill_pooled: str = option(
        "cosine", "distillation",
        "Match the pooled embeddings by cosine, or also by the batch's similarity structure (relational) or "
        "a contrastive term [default: cosine].", choices=DISTILL_POOLED)
    logging_steps: int = option(10, "run", "Log the loss and the ratio every N steps [default: 10].", type=int)
    save_steps: int = option(
        500, "run",
        "Write a checkpoint (truncated to the open ranks) every N steps [default: 500].", type=int)
    seed: int = option(
        0, "run",
        "Random seed of the data order and of any newly initialized head [default: 0].", type=int)
    # consecutive non-finite losses tolerated (each step skipped) before stopping
    max_nan_steps: int = option(
        5, "run",
        "Consecutive non-finite losses tolerated (each step skipped) before stopping [default: 5].",
        type=int, metavar="N")
    # None = on with CUDA or a CPU with native bf16 (run.default_bf16)
    bf16: bool | None = option(
        None, "hardware",
        "bf16 autocast [default: on with CUDA, or on a CPU with AVX512-BF16 or AMX].", flag="--bf16/--no-bf16")
    # torch.compile with CUDA graphs ("reduce-overhead") for the model
    compile: bool = option(False, "hardware", "torch.compile with CUDA graphs (fixed shapes).", flag_value=True)
    # Shard the parameters, gradients and AdamW's state across the workers of a torchrun run (FSDP2);
    # the rank gates stay whole on each. Off: DDP under torchrun, every worker holds everything.
    fsdp: bool = option(
        False, "hardware",
        "Shard parameters, gradients and optimizer state across the workers (FSDP2; under torchrun).", flag_value=True)
    # Cut the closed ranks out of the cores, gates and AdamW's moments at the stage switch and at each
    # quarter of the late stage (rank_cuts.py), so that steps get cheaper as ranks close; off, closed
    # ranks stay masks until the export. Never under torchrun (DDP and FSDP keep their shapes).
    cut_ranks: bool = option(
        True, "target ratio",
        "Cut closed ranks out of the cores while training, so steps get cheaper as ranks close [default: "
        "on; never under torchrun].", flag="--cut-ranks/--no-cut-ranks")
    # At the stage switch, rewrite every gated low-rank pair in the basis its inputs order (whitened
    # SVD of the trained pair, reprojection.py), so the budget closes the directions that carry least.
    # None: on under a target ratio where the ranks are cut.
    reproject: bool | None = option(
        None, "target ratio",
        "At the stage switch, rewrite the low-rank pairs in the basis their inputs order, so "
        "--target-ratio closes the directions that carry least [default: on with --target-ratio].",
        flag="--reproject/--no-reproject")
    # When --reproject rewrites the pairs: "switch" (once) or "cuts" (at the switch and at every later
    # rank cut, the Gram matrices gathered afresh in between; no better, docs/findings.md).
    reproject_at: str = option(
        "switch", "target ratio",
        "Re-project once at the switch, or at the switch and at every later rank cut [default: switch].",
        choices=REPROJECT_AT)
    max_eval_blocks: int = option(
        64, "run",
        "Held-out blocks the loss is measured on [default: 64].", type=int, metavar="N")
    version: int = option(1, "run", "The options' format version.", cli=False)

    def __post_init__(self):
        self._check_names()
        self._check_numbers()
        self._check_document_starts()
        if self.dropout is not None:
            _check_share("dropout", self.dropout)
        if self.document_starts is not None:
            _check_share("document_starts", self.document_starts)
        self._check_switches()
        self._check_budget()
        self._check_stages()

    def _check_names(self) -> None:
        """Each option that names one of a few choices, and the choices that exclude each other."""
        if self.objective not in OBJECTIVES:
            raise ConfigError(expected(f"an objective in {OBJECTIVES}", self.objective))
        if self.distill_mode not in DISTILL_MODES:
            raise ConfigError(expected(f"a distill_mode in {DISTILL_MODES}", self.distill_mode))
        if self.distill_states is not None and self.distill_states not in DISTILL_STATES:
            raise ConfigError(expected(f"a distill_states in {DISTILL_STATES}", self.distill_states))
        if self.distill_pooled not in DISTILL_POOLED:
            raise ConfigError(expected(f"a distill_pooled in {DISTILL_POOLED}", self.distill_pooled))
        if self.distill_mode == "block-wise" and self.compile:
            raise ConfigError("--distill-mode block-wise with --compile: each step feeds the blocks new "
                              "teacher states through hooks, which the CUDA graphs cannot hold (drop one of the two)")
        if self.lr_scheduler_type is not None and self.lr_scheduler_type not in LR_SCHEDULERS:
            raise ConfigError(expected(f"an lr_scheduler_type in {LR_SCHEDULERS}", self.lr_scheduler_type))

    def _check_numbers(self) -> None:
        for name in ("steps", "seq_len", "batch_size", "gradient_accumulation_steps", "logging_steps",
                     "save_steps", "max_nan_steps", "max_eval_blocks", "rank_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(expected(f"{name} as a positive integer", value))
        for name in ("lr_cores", "lr_gates", "lr_rest", "beta", "tau", "target_fraction", "mlm_probability"):
            value = getattr(self, name)
            if value is None and name in PRETRAINING_DEFAULTS:
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(expected(f"{name} as a non-negative number", value))
        warmup = self.warmup_steps
        if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0):
            raise ConfigError(expected("warmup_steps as a non-negative integer", self.warmup_steps))
        if self.minutes is not None:
            if isinstance(self.minutes, bool) or not isinstance(self.minutes, (int, float)) \
                    or not math.isfinite(self.minutes) or self.minutes <= 0:
                raise ConfigError(expected("minutes as a positive number", self.minutes))

    def _check_document_starts(self) -> None:
        start = self.start_min_tokens
        if start is not None and (isinstance(start, bool) or not isinstance(start, int)
                                  or not 1 <= start <= self.seq_len):
            raise ConfigError(expected(f"start_min_tokens between 1 and seq_len ({self.seq_len})", start))
        longest = self.start_max_tokens
        if longest is not None and (isinstance(longest, bool) or not isinstance(longest, int)
                                    or longest < self.seq_len):
            raise ConfigError(expected(f"start_max_tokens as an integer of at least seq_len ({self.seq_len})",
                                       longest))
        if self.varies_lengths and self.compile:
            flag = "--start-min-tokens" if start is not None else "--start-max-tokens"
            raise ConfigError(f"{flag} with --compile: document starts of many lengths make batches of many "
                              "lengths, and the compiled CUDA graphs need one shape (drop one of the two)")

    def _check_switches(self) -> None:
        for name in ("gradient_checkpointing", "fsdp", "cut_ranks", "reproject"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "reproject" and value is None):
                raise ConfigError(expected(f"{name} as true or false", value))
        if self.reproject and (not self.budgeted or not self.cut_ranks):
            raise ConfigError("--reproject orders the directions a --target-ratio budget closes, at the rank "
                              "cuts: it needs --target-ratio and the cuts (drop --no-cut-ranks)")

    def _check_budget(self) -> None:
        """The options that shape --target-ratio's size budget, and when --reproject rewrites the pairs."""
        for name in ("budget_share", "last_block_floor"):
            if getattr(self, name) is not None:
                _check_nonzero_share(name, getattr(self, name))
        if self.late_objective is not None and self.late_objective not in LATE_OBJECTIVES:
            raise ConfigError(expected(f"late_objective in {LATE_OBJECTIVES}", self.late_objective))
        budget_only = [flag for flag, given in (("--budget-share", self.budget_share is not None),
                                                ("--late-objective", self.late_objective is not None),
                                                ("--last-block-floor", self.last_block_floor is not None)) if given]
        if budget_only and not self.budgeted:
            verb = "shape" if len(budget_only) > 1 else "shapes"
            raise ConfigError(f"{', '.join(budget_only)} {verb} the size budget of --target-ratio: add "
                              "--target-ratio (without it the late stage's min-max sets the size)")
        if self.reproject_at not in REPROJECT_AT:
            raise ConfigError(expected(f"reproject_at in {REPROJECT_AT}", self.reproject_at))
        if self.reproject_at != "switch" and not self.reprojects:
            raise ConfigError(f"--reproject-at {self.reproject_at} says when --reproject rewrites the pairs: "
                              "add --reproject")

    def _check_stages(self) -> None:
        """--target-ratio and the two stages: a target ratio needs a late stage to compress in."""
        if not 0 < self.target_fraction <= 1:
            raise ConfigError(expected("target_fraction in (0, 1]", self.target_fraction))
        if self.target_ratio is not None and (not isinstance(self.target_ratio, (int, float))
                                              or self.target_ratio <= 1):
            raise ConfigError(expected("a target ratio greater than 1", self.target_ratio))
        self._check_speed_target()
        if self.early_steps is not None and not 0 <= self.early_steps <= self.steps:
            raise ConfigError(expected(f"early_steps between 0 and steps ({self.steps})", self.early_steps))
        early = self.early_steps if self.early_steps is not None else self.default_early_steps()
        if self.budgeted and early >= self.steps:
            raise ConfigError(f"{self.target_flag} needs a late stage to compress in: {self.steps} steps with "
                              f"{early} early steps leave none (lower --early-steps or raise --steps)")

    def _check_speed_target(self) -> None:
        """--target-speedup: above 1, not with --target-ratio, and --runtime only with it."""
        if self.target_speedup is not None and (not isinstance(self.target_speedup, (int, float))
                                                or isinstance(self.target_speedup, bool) or self.target_speedup <= 1):
            raise ConfigError(expected("a target speedup greater than 1 (the dense model's speed is 1)",
                                       self.target_speedup))
        if self.target_speedup is not None and self.target_ratio is not None:
            raise ConfigError("--target-speedup and --target-ratio each set the late stage's budget: choose one "
                              "(a speed to reach, or a size)")
        if self.runtime is not None and self.runtime not in SPEED_RUNTIMES:
            raise ConfigError(expected(f"a runtime in {SPEED_RUNTIMES}", self.runtime))
        if self.runtime is not None and self.target_speedup is None:
            raise ConfigError(f"--runtime {self.runtime} says where --target-speedup is measured: add --target-speedup")

    @property
    def budgeted(self) -> bool:
        """Whether the late stage closes gates to a budget: a --target-ratio (parameters) or a --target-speedup
        (microseconds)."""
        return self.target_ratio is not None or self.target_speedup is not None

    @property
    def target_flag(self) -> str:
        """The flag that set the budget, for messages."""
        return "--target-speedup" if self.target_speedup is not None else "--target-ratio"

    @property
    def speed_runtime(self) -> str:
        """Where a speed target is measured: --runtime, else OpenVINO."""
        return self.runtime or DEFAULT_SPEED_RUNTIME

    def default_early_steps(self) -> int:
        """The early stage's steps where none are given (``plan_training`` gives them)."""
        if self.budgeted:
            return max(1, math.ceil(TARGET_EARLY_SHARE * self.steps))
        return max(1, (2 * self.steps) // 3)

    @property
    def reprojects(self) -> bool:
        """Whether the pairs are re-projected: as set, or by default under a target ratio where the
        ranks are cut."""
        return self.reproject if self.reproject is not None else self.budgeted and self.cut_ranks

    @property
    def varies_lengths(self) -> bool:
        """Whether drawn document starts are cut short or run past seq_len, so that blocks (and
        steps) differ in length (an unset document_starts may still default to a share of them)."""
        longer = self.start_max_tokens is not None and self.start_max_tokens > self.seq_len
        return (self.start_min_tokens is not None or longer) and self.document_starts != 0

    @classmethod
    def from_dict(cls, data: dict, origin: str = "options") -> "TrainOptions":
        """Options from a mapping (a recipe's), listing the valid keys on a typo."""
        return from_mapping(cls, data, origin)

    def to_dict(self) -> dict:
        """The options as a plain mapping (what the report and history record)."""
        return asdict(self)
