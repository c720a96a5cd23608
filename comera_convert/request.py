"""ConvertRequest: what the user wants of a conversion, validated and nothing more.

Python callers (``comera_convert.convert(model, ratio=4)``), recipes and ``comera convert`` build the same
object; the CLI's flags are generated from its fields (``cli/dataclass_options.py``), so each field's help,
choices and flag live here once. Fields left ``None`` are the user's "choose for me": the plan
(``conversion/plan.py``) derives them from the request and the model's shape, once, with a reason for each.

The request is torch-free and imports nothing from ``conversion/``, so that ``comera convert --help``
stays quick and the configuration never depends on the code that carries it out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .choices import ALLOCATIONS, FFN_METHODS, FLOAT_STORAGE, INTEGER_STORAGE, LAYOUTS, WORD_EMBEDDINGS
from .errors import ConfigError, expected
from .option_files import from_mapping, option

# The concerns a request's fields are grouped by (each field's "concern"; `comera convert --help` lists them
# in this order).
CONCERNS = ("rank budget", "factorization", "calibration", "storage", "placement")
# Sequences per calibration pass. Reconstruction holds the last batch out to check each block and
# trains on the rest, so it needs two at least (conversion/calibration.py reads the same number).
CALIBRATION_BATCH = 16
RECONSTRUCTION_MIN_SEQUENCES = 2 * CALIBRATION_BATCH
# The largest per-layer multiple of the shared rank rank_scales may ask for, far above what learned
# scales reach; a layer at its break-even rank stays dense.
MAX_RANK_SCALE = 64.0
# The allocations that share one maximum rank out (scaled per layer): the ones a codebook word
# table, which costs the same at every rank, works with.
SHARED_RANK = ("uniform", "learned")


@dataclass
class ConvertRequest:
    """What a conversion should do, validated on construction: an out-of-range value raises
    ``ConfigError`` saying what was expected and what came in. Nothing here is derived from another field
    or from the model; ``plan(request, model)`` does that."""

    CONCERNS = CONCERNS

    ratio: float | None = option(
        4.0, "rank budget", "Shrink the whole model this many times [default: 4].", type=float)
    rank: int | None = option(
        None, "rank budget", "A fixed max rank for every layer instead of --ratio (CoMERA uses 30).", type=int)
    allocation: str = option(
        "uniform", "rank budget",
        "One shared rank (uniform); the block stack's ranks learned end to end on the calibration text before "
        "converting (learned); per-kind rank scales searched on it (measured); or per-layer ranks from error "
        "estimates (sensitivity) [default: uniform].", choices=ALLOCATIONS)
    rank_scales: dict[str, float] | None = option(
        None, "rank budget",
        "--allocation learned: the per-layer rank scales to use instead of learning them, a JSON object of layer "
        "name -> multiple of the shared rank, or a checkpoint's comera_report.json (its learned scales).",
        metavar="FILE", parse="rank-scales")
    learning_steps: int | None = option(
        None, "rank budget", "Adam steps of --allocation learned [default: by the model's size: MiniLM 100, "
        "a bert-base 40].", type=int, metavar="N")
    rank_multiple: int = option(
        1, "rank budget", "Round the ranks --ratio chooses down to multiples of this; 8 for faster bf16 on GPUs "
        "[default: 1].", type=int)
    embedding_rank_scale: float = option(
        1.5, "rank budget", "The word embedding's ranks are X times the shared rank (the uniform allocation) "
        "[default: 1.5].", type=float, metavar="X")
    last_block_rank_scale: float = option(
        2.0, "rank budget", "The last repeated block's layers get X times the shared rank (the uniform "
        "allocation; a fixed --rank and the experimental allocations do not read it); 1: one shared rank "
        "[default: 2].", type=float, metavar="X")
    keep_last_attention_output: bool = option(
        True, "rank budget", "Keep the last repeated block's attention output projection dense (the uniform "
        "allocation) [default: keep].", flag="--keep-last-attention-output/--factorize-last-attention-output")

    layout: str = option(
        "tt", "factorization", "Layout of linear layers: tt (CoMERA) or ttm [default: tt].")
    embedding_layout: str = option(
        "tt", "factorization", "Layout of embeddings: tt or ttm (CoMERA) [default: tt].")
    d: int | None = option(
        None, "factorization", "Tensor modes per side, 1 (plain low-rank, a truncated SVD) to 4 [default: 1 with "
        "--ratio and a codebook table; with a tt table or ttm 3 below --ratio 3, 2 from 3, 1 from 4 (tt); 3 with "
        "--rank].", flag="--modes", type=int)
    word_embedding: str | None = option(
        None, "factorization", "The input embedding as a tt, or as a codebook table (one byte per 4 columns of a "
        "row, shared centres) whose savings go to the linears [default: codebook with --ratio, tt with --rank].",
        choices=WORD_EMBEDDINGS)
    codebook_width: int = option(
        4, "factorization", "Columns per slice of a codebook table: each row stores one byte per N columns; 8 "
        "halves the codes' bytes (what --ratio 8 --dtype int4 needs for 32x) [default: 4].", type=int, metavar="N")
    ffn: str | None = option(
        None, "factorization", "Each block's feed-forward pair as two low-rank layers, or with whole hidden neurons "
        "pruned for the same parameters and its second layer refit on the calibration text (BERT-family encoders) "
        "[default: prune where calibrated with a --ratio and the uniform allocation, low-rank elsewhere].",
        choices=FFN_METHODS)
    targets: list[str] | None = option(
        None, "factorization", "Comma-separated module-name patterns to convert.", parse="patterns")
    exclude: list[str] | None = option(
        None, "factorization", "Comma-separated module-name patterns to keep dense.", parse="patterns")
    gates: bool = option(
        True, "factorization", "Leave out the rank gates (no rank adaptation).", flag="--no-gates", flag_value=False)

    calibration: str | None = option(
        None, "calibration", "Data-aware init: minimize each layer's error on this text's activations (english, "
        "python-stdlib, english+python-stdlib, a file, folder, JSONL or dataset) [default: english+python-stdlib].",
        metavar="DATA")
    calibration_sequences: int | None = option(
        None, "calibration", "Calibration sequences [default: 128; where compensating, as many as the model's size "
        "allows, up to 512: MiniLM 512, a bert-base 144, 1 B parameters 128].", type=int)
    calibration_seq_len: int = option(
        128, "calibration", "Tokens per calibration sequence [default: 128].", type=int, metavar="N")
    compensate: bool | None = option(
        None, "calibration", "Fit each layer to the inputs the compressed layers before it produce, not to the "
        "dense model's (calibrating block by block) [default: where --ratio cuts the factorized layers at all: "
        "MiniLM from --ratio 1.92, a bert-base from 1.25].", flag="--compensate/--no-compensate")
    reconstruct_steps: int | None = option(
        None, "calibration", "Tune each block for N Adam steps to reproduce the dense block's outputs after the "
        "closed-form fit (block-wise reconstruction) [default: where compensating, given 32 calibration "
        "sequences, 300 or fewer for larger blocks: MiniLM 205 at --ratio 4, a bert-base 75; 0: off].",
        type=int, metavar="N")
    reconstruct_lr: float = option(
        1e-3, "calibration", "The learning rate of block-wise reconstruction (a block that rejects its tuning is "
        "tuned once more at 0.3 of it) [default: 1e-3].", type=float, metavar="LR")

    dtype: str | None = option(
        None, "storage", "Store the checkpoint in float32, bfloat16 or float16, or its factors as int8 (a scale "
        "per channel) or int4 (a scale per group) [default: the source's].", metavar="DTYPE")
    group_size: int | None = option(
        None, "storage", "Integer storage: a scale per N values of a channel (N must divide every width) "
        "[default: int8 per channel, int4 128].", type=int, metavar="N")
    version: int = option(1, "storage", "The checkpoint format's version.", cli=False)

    device: str | None = option(
        None, "placement", "Run the decompositions on DEVICE (cuda, cuda:1); reading and writing stay on the host "
        "[default: where the weights are].", metavar="DEVICE")

    def __post_init__(self):
        self._check_budget()
        self._check_counts()
        self._check_factorization()
        self._check_allocation()
        self._check_learned()
        self._check_scales()
        self._check_calibration()
        self._check_storage()
        self._check_patterns()

    @property
    def budget_ratio(self) -> float | None:
        """The ratio the budget follows: None where a fixed rank is given, which replaces the ratio."""
        return self.ratio if self.rank is None else None

    @property
    def ttm(self) -> bool:
        return "ttm" in (self.layout, self.embedding_layout)

    def _check_budget(self) -> None:
        if self.rank is None and self.ratio is None:
            raise ConfigError("give a compression ratio or a rank")
        if self.rank is None:
            try:
                self.ratio = float(self.ratio)
            except (TypeError, ValueError):
                raise ConfigError(expected("a ratio as a number greater than 1", self.ratio)) from None
            if not math.isfinite(self.ratio) or self.ratio <= 1:
                raise ConfigError(expected("a ratio greater than 1", self.ratio))
        elif isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(expected("a rank as a positive integer", self.rank))

    def _check_counts(self) -> None:
        for name in ("calibration_sequences", "calibration_seq_len", "rank_multiple", "codebook_width"):
            value = getattr(self, name)
            if name == "calibration_sequences" and value is None:
                continue  # chosen by the plan, by the model's size
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                what = "codebook_width as a positive integer (columns per slice)" if name == "codebook_width" else \
                    f"{name} as a positive integer"
                raise ConfigError(expected(what, value))
        steps = self.learning_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(expected("learning_steps as a positive whole number", steps))

    def _check_factorization(self) -> None:
        for name in ("layout", "embedding_layout"):
            if getattr(self, name) not in LAYOUTS:
                raise ConfigError(expected(f"{name} in {LAYOUTS}", getattr(self, name)))
        if self.d is not None and self.d not in (1, 2, 3, 4):
            raise ConfigError(expected("d (modes per side) in (1, 2, 3, 4)", self.d))
        if self.d == 1 and self.ttm:
            raise ConfigError("--modes 1 is a plain low-rank factorization (truncated SVD: one core per side), "
                              "which needs the tt layout: a one-mode ttm is the dense matrix itself "
                              f"(got layout {self.layout}, embedding_layout {self.embedding_layout})")
        for name, known in (("word_embedding", WORD_EMBEDDINGS), ("ffn", FFN_METHODS)):
            value = getattr(self, name)
            if value is not None and value not in known:
                raise ConfigError(expected(f"{name} in {known}", value))
        if self.compensate is not None and not isinstance(self.compensate, bool):
            raise ConfigError(expected("compensate as true or false", self.compensate))

    def _check_allocation(self) -> None:
        """The allocation against the budget and the word table it works with."""
        if self.allocation not in ALLOCATIONS:
            raise ConfigError(expected(f"allocation in {ALLOCATIONS}", self.allocation))
        if self.allocation != "uniform" and self.rank is not None:
            raise ConfigError(f"allocation {self.allocation!r} splits a --ratio budget between layers; it does "
                              f"not apply to a fixed --rank {self.rank}")
        if self.rank_multiple != 1 and self.rank is not None:
            raise ConfigError(f"rank_multiple rounds the ranks a --ratio budget chooses; a fixed --rank "
                              f"{self.rank} is used as given")
        if self.rank_multiple != 1 and self.allocation == "sensitivity":
            raise ConfigError("rank_multiple applies to the uniform and measured allocations; the "
                              "sensitivity allocation climbs its own ladder of ranks")
        if self.word_embedding == "codebook" and self.allocation not in SHARED_RANK:
            raise ConfigError(f"a codebook word embedding works with the uniform and learned allocations, not "
                              f"{self.allocation!r}: give --word-embedding tt for it")

    def _check_learned(self) -> None:
        scales = self.rank_scales
        if self.allocation == "learned" and scales is None and self.d not in (None, 1):
            raise ConfigError(f"allocation 'learned' learns the rank of each layer's low-rank pair (--modes 1, the "
                              f"default with a codebook word table); got --modes {self.d}")
        if scales is None:
            return
        if self.allocation != "learned":
            raise ConfigError(f"rank_scales are the learned allocation's per-layer ranks: give allocation learned "
                              f"with them, not {self.allocation!r}")
        if not isinstance(scales, dict) or not all(
                isinstance(name, str) and not isinstance(value, bool) and isinstance(value, (int, float))
                and math.isfinite(value) and 0 < value <= MAX_RANK_SCALE for name, value in scales.items()):
            raise ConfigError(expected(f"rank_scales as a mapping of layer names to numbers in (0, {MAX_RANK_SCALE}]",
                                       scales))
        self.rank_scales = {name: float(value) for name, value in scales.items()}

    def _check_scales(self) -> None:
        if not isinstance(self.keep_last_attention_output, bool):
            raise ConfigError(expected("keep_last_attention_output as true or false",
                                       self.keep_last_attention_output))
        for name in ("embedding_rank_scale", "last_block_rank_scale"):
            scale = getattr(self, name)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 16:
                raise ConfigError(expected(f"{name} as a number in (0, 16]", scale))

    def _check_calibration(self) -> None:
        steps, lr = self.reconstruct_steps, self.reconstruct_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ConfigError(expected("reconstruct_lr as a positive number", lr))
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ConfigError(expected("reconstruct_steps as a whole number of steps (0: off)", steps))
        given = self.calibration_sequences
        if steps and self.calibration is not None and given is not None and given < RECONSTRUCTION_MIN_SEQUENCES:
            raise ConfigError(f"reconstruction holds out {CALIBRATION_BATCH} calibration sequences to check each "
                              f"block and trains on the rest: give at least {RECONSTRUCTION_MIN_SEQUENCES} "
                              f"(--calibration-sequences {given})")
        if self.calibration is None:
            return
        if not isinstance(self.calibration, str) or not self.calibration:
            raise ConfigError(expected("calibration as a data source (a path, dataset name, english or "
                                       "python-stdlib)", self.calibration))
        from .text import check_source, read_for  # reads corpora lists: not needed for --help

        with read_for("--calibration"):  # a missing file refused here, not after the model has loaded
            check_source(self.calibration)

    def _check_storage(self) -> None:
        dtype, size = self.dtype, self.group_size
        if dtype is not None:
            check_storage_name(dtype)
        if size is not None and dtype is None:
            raise ConfigError("--group-size applies to integer storage: give --dtype int8 or int4 with it")
        if size is not None and dtype not in INTEGER_STORAGE:
            raise ConfigError(f"--group-size applies to integer storage (--dtype int8 or int4), not --dtype {dtype}")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 2 or size % 2):
            raise ConfigError(expected("a group size as an even integer of 2 or more (values per scale)", size))
        if self.device is not None:
            check_device(self.device)

    def _check_patterns(self) -> None:
        for name in ("targets", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = [value]
            if value is not None and not all(isinstance(p, str) and p for p in value):
                raise ConfigError(expected(f"{name} as a list of module-name patterns", value))
            setattr(self, name, list(value) if value else None)

    @classmethod
    def from_dict(cls, data: dict, origin: str = "options") -> "ConvertRequest":
        """A request from a mapping (a recipe's), listing the valid keys on a typo."""
        return from_mapping(cls, data, origin)

    def to_dict(self) -> dict:
        """The request as a plain mapping (what a recipe and the report hold)."""
        return asdict(self)

    def with_changes(self, **changes) -> "ConvertRequest":
        """This request with ``changes``, validated the same way (unknown names listed)."""
        return from_mapping(type(self), {**self.to_dict(), **changes}, "convert()")


# The name the library has exported since 0.1.0: a request holds the options a conversion was given.
ConvertOptions = ConvertRequest


def check_storage_name(name: str) -> None:
    """Refuse a ``--dtype`` that is none of the storage names, listing them all."""
    if name not in (*FLOAT_STORAGE, *INTEGER_STORAGE):
        raise ConfigError(f"--dtype {name!r} is not a storage dtype "
                          f"(expected one of {', '.join([*FLOAT_STORAGE, *INTEGER_STORAGE])})")


def check_device(name: str) -> None:
    """Refuse a device torch does not know, or a CUDA device this machine lacks, in one line."""
    import torch  # only where a device is named: the request stays torch-free for --help

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(expected("--device as cpu, cuda or cuda:N", name)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available here (torch.cuda.is_available() is False)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(expected("--device as cpu, cuda or cuda:N", name))
