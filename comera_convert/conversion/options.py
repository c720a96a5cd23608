"""ConvertOptions: every conversion option, validated on construction (also what recipes hold)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, asdict, dataclass

from ..choices import ALLOCATIONS, FFN_METHODS, WORD_EMBEDDINGS
from ..errors import ConfigError, expected
from ..option_files import from_mapping
from ..tt.spec import LAYOUTS
from .calibration import BATCH as CALIBRATION_BATCH, CALIBRATION_OPTION, DEFAULT_SEQUENCES
from .learned import LEARNING_STEP_BUDGET, LEARNING_STEPS, MIN_LEARNING_STEPS
from .storage import check_storage

# With a codebook word table (the default with --ratio), compensation, reconstruction and the
# calibration's size follow how hard the ratio cuts the factorized layers (``regime.layers_cut``), not
# the ratio: a model gets what MiniLM got where its layers are cut as hard. With a TT table every
# layer is factorized, so the defaults follow the ratio (the *_FROM_RATIO thresholds).
#
# Modes per side: one (a whitened truncated SVD) with a codebook table and the tt layout, which keeps
# as much or more at every cut measured and trains faster. A TT table and the ttm layout need modes:
# three below TWO_MODES_FROM_RATIO, two from it, one from ONE_MODE_FROM_RATIO (tt). A fixed --rank
# keeps CoMERA's three. docs/findings.md
TWO_MODES_FROM_RATIO = 3.0
ONE_MODE_FROM_RATIO = 4.0
# Compensation (and reconstruction with it) pays wherever the layers are cut at all once the
# calibration mixes english and code; with a TT table from --ratio 3.
# docs/findings.md
COMPENSATE_ABOVE_CUT = 1.0  # strict: a model whose linears are too small to convert (cut 1.0) does not calibrate
COMPENSATE_FROM_RATIO = 3.0
# The options whose defaults depend on others (the ratio, the table, the model's cut): chosen
# again when those change (``replace``, ``for_model``).
DEPENDENT_DEFAULTS = ("d", "compensate", "reconstruct_steps", "ffn")
# Reconstruction's Adam steps a block where it is on by default; more saturate (600 and 900 moved
# cosine by 0.01 at most). docs/findings.md
RECONSTRUCT_STEPS = 300
# Its cost grows with the compressed block, so a block gets at most 100 steps of a 1.6 M-parameter
# block's work (never under MIN_RECONSTRUCT_STEPS): a bert-base-shaped conversion stays near five
# minutes on two cores. docs/findings.md
RECONSTRUCTION_STEP_BUDGET = 100 * 1_600_000
MIN_RECONSTRUCT_STEPS = 25
# Calibration sequences where compensation is on and none were given: more text keeps more up
# to 512 and flattens past it, and its passes cost tokens x parameters, so a model gets what this
# many parameter-tokens buy (a bert-base 144, MiniLM 512, a 1.1 B Llama 128).
# docs/findings.md
CALIBRATION_PARAM_TOKENS = 144 * 128 * 110_000_000
MAX_CALIBRATION_SEQUENCES = 512
# Reconstruction holds out the last calibration batch and trains on the others.
RECONSTRUCTION_HELD_OUT = CALIBRATION_BATCH
RECONSTRUCTION_MIN_SEQUENCES = 2 * RECONSTRUCTION_HELD_OUT


# The allocations that share one maximum rank out (scaled per layer): the ones a codebook word
# table, which costs the same at every rank, works with.
SHARED_RANK = ("uniform", "learned")
# The largest per-layer multiple of the shared rank rank_scales may ask for, far above what learned
# scales reach; a layer at its break-even rank stays dense.
MAX_RANK_SCALE = 64.0


def default_modes(ratio: float | None, *, codebook: bool = False, ttm: bool = False) -> int:
    """Modes per side for a --ratio (None: a fixed --rank, CoMERA's three): one with a ``codebook``
    table and the tt layout, at every cut measured; else by the ratio, two or more with a ttm layout
    (one ttm mode would be the dense matrix itself)."""
    if ratio is None:
        return 3
    if codebook and not ttm:
        return 1
    if ratio < TWO_MODES_FROM_RATIO:
        return 3
    return 1 if ratio >= ONE_MODE_FROM_RATIO and not ttm else 2


def default_ffn(ratio: float | None, *, allocation: str, d: int, calibrated: bool) -> str:
    """What a block's feed-forward pair becomes by default: pruned by neuron where a --ratio's uniform
    allocation gives it low-rank pairs (one mode) and calibration text refits it, which kept more of
    dense recall@1 in the mean of four domains, and higher cosine on each, on both encoders at every
    ratio measured (MiniLM 2 to 8, all-mpnet-base-v2 2 to 8, float and integer); low-rank elsewhere:
    a fixed --rank (CoMERA's TT, for rank-adaptive training), the other allocations, TT modes, and an
    uncalibrated conversion, which cannot refit.
    docs/findings.md"""
    prune = ratio is not None and allocation == "uniform" and d == 1 and calibrated
    return "prune" if prune else "low-rank"


def default_compensation(ratio: float | None, cut: float | None, *, codebook: bool) -> bool:
    """Whether a --ratio (None: a fixed --rank) compensates by default: by the factorized layers'
    ``cut`` with a codebook table, by the ratio with a TT table."""
    if ratio is None:
        return False
    return cut > COMPENSATE_ABOVE_CUT if codebook else ratio >= COMPENSATE_FROM_RATIO


@dataclass
class ConvertOptions:
    """Every conversion option, validated on construction (what recipes hold; ``comera convert``'s flags).

    Fields left ``None`` take defaults that depend on the others (``for_model`` chooses them once the model is
    known). Out-of-range values raise ``ConfigError`` saying what was expected and what came in."""
    # The whole model (dense parameters included) shrinks at least this many times.
    ratio: float | None = 4.0
    # A fixed maximum rank for every converted layer instead of a ratio (CoMERA uses 30).
    rank: int | None = None
    # tt (in modes, then out modes) for linears, as CoMERA. Embeddings are tt too, where CoMERA
    # uses ttm: a head tied to a tt table runs through its two halves instead of the whole table
    # (a faster step), and per parameter the tt table is the closer one.
    # docs/speed.md
    layout: str = "tt"
    embedding_layout: str = "tt"
    # Modes per side: CoMERA splits 768 and 3072 into 3 modes each. 1 is a plain low-rank
    # factorization: a truncated SVD (whitened when calibrated) with the same rank allocation.
    # None picks (default_modes): 1 with a --ratio and a codebook table; with a TT table or a ttm
    # layout 3 below TWO_MODES_FROM_RATIO, 2 from it, 1 from ONE_MODE_FROM_RATIO (tt layout); 3 with
    # a fixed --rank.
    d: int | None = None
    targets: list[str] | None = None
    exclude: list[str] | None = None
    # Diagonal rank gates on every bond, for rank-adaptive training (`comera train`).
    gates: bool = True
    # Data-aware conversion: text whose activations weight each layer's decomposition (a data
    # source as `comera train --data` takes, e.g. "python-stdlib"); None = plain TT-SVD.
    calibration: str | None = None
    # Sequences of calibration text; None: DEFAULT_SEQUENCES, or where compensating as many as the
    # model's size allows (``sequences_for``, CALIBRATION_PARAM_TOKENS).
    calibration_sequences: int | None = None
    calibration_seq_len: int = 128
    # Calibrating block by block (`comera convert` of a safetensors checkpoint), fit each linear
    # layer to the inputs the already compressed layers before it produce, so that errors do not
    # compound (pipeline/compensating.py). False: every layer fit to the dense model's inputs. None
    # (default_compensation): above COMPENSATE_ABOVE_CUT with a codebook table, from
    # COMPENSATE_FROM_RATIO with a TT table, off below and for a fixed --rank.
    compensate: bool | None = None
    # Block-wise reconstruction (pipeline/reconstruction.py): after the closed-form fit, each block's
    # factors, biases and norms are tuned for this many Adam steps (8 sequences each, at
    # reconstruct_lr, decayed to zero) to reproduce the dense block's outputs from the inputs the
    # compressed blocks before it give; kept only where it lowers the distance on a held-out
    # calibration batch, else tuned once more at a lower rate (reconstruction.RETRY_LR_SHARE). 0: off.
    # None follows the cut, as compensation does: RECONSTRUCT_STEPS above COMPENSATE_ABOVE_CUT, off
    # below and for a fixed --rank.
    reconstruct_steps: int | None = None
    reconstruct_lr: float = 1e-3
    # How --ratio's budget is split: "uniform" (one shared maximum rank), "learned" (the block stack's
    # linears at per-layer multiples of it, learned end to end on the calibration text before the
    # conversion: conversion/learned.py), "measured" (per-kind rank scales searched end to end on the
    # calibration text; conversion/experimental/measured.py) or "sensitivity" (per layer, from the
    # calibration data's error estimates; conversion/experimental/sensitivity.py). The last two are
    # experimental: neither beat the shared rank out of domain after training (strategies.py).
    allocation: str = "uniform"
    # What a block's feed-forward pair (BERT-family intermediate.dense -> act -> output.dense) becomes
    # where the allocation compresses both of its layers: "low-rank" (two pairs of factors, as every
    # other linear) or "prune" (the same parameters spent on whole hidden neurons, down refit on the
    # calibration text: conversion/pruning.py). None (default_ffn): prune where calibrated with a
    # --ratio and the uniform allocation, low-rank elsewhere.
    ffn: str | None = None
    # The learned allocation's per-layer rank scales (module name -> multiple of the shared rank), as
    # a conversion's report records them: given, they are used as they are instead of learned again.
    rank_scales: dict[str, float] | None = None
    # Adam steps of the learned allocation (conversion/learned.py); None: by the model's size
    # (``learning_steps_for``).
    learning_steps: int | None = None
    # The ranks --ratio chooses are multiples of this. 8 suits GPU tensor cores in bf16 (ranks off
    # that grid fall to slower kernels); 1 spends the whole budget.
    # BENCHMARKS.md#training-on-a-gpu-step-time-and-memory
    rank_multiple: int = 1
    # The input (word) embedding's ranks are this many times the shared rank (uniform allocation): it
    # carries every token's meaning into mean pooling; 2.5 and more starve the linears.
    # docs/findings.md
    embedding_rank_scale: float = 1.5
    # The layers of the last repeated block (a BERT's last encoder layer, a decoder's last layer)
    # get this many times the shared rank (uniform allocation): their error reaches the output with
    # no later layer to compensate it. 1: one shared rank. A fixed --rank and the experimental
    # allocations do not read it. docs/findings.md
    last_block_rank_scale: float = 2.0
    # The last repeated block's attention output projection (BERT's attention.output.dense, GPT-2's
    # attn.c_proj, Llama's self_attn.o_proj) stays dense: on MiniLM it is the one layer whose
    # compression costs the embedding most, for one square matrix (0.5 % of a bert-base).
    # docs/findings.md
    keep_last_attention_output: bool = True
    # The input (word) embedding as "tt" (as the other embeddings) or as a "codebook": product-
    # quantized (codebook/), each row one byte per slice of codebook_width columns. A TT over token
    # ids keeps the rows of the most frequent tokens; a codebook keeps every row coarsely, and what it
    # saves goes to the linears. None: codebook with a --ratio, tt with a fixed --rank (CoMERA's).
    # docs/findings.md
    word_embedding: str | None = None
    # Columns per codebook slice: 4 by an early study on MiniLM; 8 halves the codes' bytes.
    codebook_width: int = 4
    # The dtype the checkpoint stores its tensors in (float32, bfloat16, float16); None keeps the
    # source's. bfloat16 halves a float32 checkpoint. int8 and int4 store every factor and dense
    # matrix as integers with float16 scales, a scale per channel (int8) or per group_size values
    # of a channel (int4: 128 unless given), read back as floats (conversion/storage.py).
    dtype: str | None = None
    group_size: int | None = None
    # Where the decompositions run ("cuda", "cuda:1", "cpu"); None: where each layer's weight is.
    # The TT layers come back to the weight's device, so a streamed conversion reads and writes on
    # the host while a GPU does the arithmetic.
    device: str | None = None
    version: int = 1
    # How hard the ratio cuts the factorized layers (``regime.layers_cut``), which compensation and
    # reconstruction follow with a codebook table; given by ``for_model``. Until the model is known
    # the ratio stands in for it (the cut of a model of linear layers alone). Kept as ``cut``.
    layers_cut: InitVar[float | None] = None

    def __post_init__(self, layers_cut: float | None = None):
        self._check_budget()
        for name in ("layout", "embedding_layout"):
            if getattr(self, name) not in LAYOUTS:
                raise ConfigError(expected(f"{name} in {LAYOUTS}", getattr(self, name)))
        self._choose_shape(layers_cut)
        self._check_allocation()
        self._check_learned()
        self._choose_fitting()
        self._check_storage()
        self._check_reconstruction()
        self._check_scales()
        self._check_calibration()
        self._check_patterns()

    @property
    def _ttm(self) -> bool:
        return "ttm" in (self.layout, self.embedding_layout)

    @property
    def _budget_ratio(self) -> float | None:
        """The ratio, None for a fixed --rank."""
        return self.ratio if self.rank is None else None

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

    def _choose_shape(self, layers_cut: float | None) -> None:
        """The word table's kind, the cut and the modes where not given, and the modes checked."""
        if self.word_embedding is None:
            self.word_embedding = "codebook" if self.rank is None and self.allocation in SHARED_RANK else "tt"
        self._defaulted = frozenset(name for name in DEPENDENT_DEFAULTS if getattr(self, name) is None)
        ratio = self._budget_ratio
        self.cut = None if ratio is None else layers_cut if layers_cut is not None else ratio
        if self.d is None:
            self.d = default_modes(ratio, codebook=self.word_embedding == "codebook", ttm=self._ttm)
        if self.d not in (1, 2, 3, 4):
            raise ConfigError(expected("d (modes per side) in (1, 2, 3, 4)", self.d))
        if self.d == 1 and self._ttm:
            raise ConfigError("--modes 1 is a plain low-rank factorization (truncated SVD: one core per "
                              "side), which needs the tt layout: a one-mode ttm is the dense matrix itself "
                              f"(got layout {self.layout}, embedding_layout {self.embedding_layout})")

    def _check_allocation(self) -> None:
        """The allocation against the budget, the counts it reads, and the word table it works with."""
        if self.allocation not in ALLOCATIONS:
            raise ConfigError(expected(f"allocation in {ALLOCATIONS}", self.allocation))
        if self.allocation != "uniform" and self.rank is not None:
            raise ConfigError(f"allocation {self.allocation!r} splits a --ratio budget between layers; it does "
                              f"not apply to a fixed --rank {self.rank}")
        for name in ("calibration_sequences", "calibration_seq_len", "rank_multiple"):
            value = getattr(self, name)
            if name == "calibration_sequences" and value is None:
                continue  # chosen by the model's size (sequences_for)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(expected(f"{name} as a positive integer", value))
        self._check_rank_multiple()
        if self.word_embedding not in WORD_EMBEDDINGS:
            raise ConfigError(expected(f"word_embedding in {WORD_EMBEDDINGS}", self.word_embedding))
        if self.word_embedding == "codebook" and self.allocation not in SHARED_RANK:
            raise ConfigError(f"a codebook word embedding works with the uniform and learned allocations, not "
                              f"{self.allocation!r}: give --word-embedding tt for it")

    def _check_rank_multiple(self) -> None:
        if self.rank_multiple != 1 and self.rank is not None:
            raise ConfigError(f"rank_multiple rounds the ranks a --ratio budget chooses; a fixed --rank "
                              f"{self.rank} is used as given")
        if self.rank_multiple != 1 and self.allocation == "sensitivity":
            raise ConfigError("rank_multiple applies to the uniform and measured allocations; the "
                              "sensitivity allocation climbs its own ladder of ranks")

    def _choose_fitting(self) -> None:
        """Compensation, reconstruction and the feed-forward pairs' handling where not given, then checked."""
        width = self.codebook_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ConfigError(expected("codebook_width as a positive integer (columns per slice)", width))
        ratio, codebook = self._budget_ratio, self.word_embedding == "codebook"
        compensating = default_compensation(ratio, self.cut, codebook=codebook)
        if self.compensate is None:
            self.compensate = compensating
        if self.reconstruct_steps is None:  # on where compensation is, given the sequences it holds out
            on = compensating and self.fewest_sequences >= RECONSTRUCTION_MIN_SEQUENCES
            self.reconstruct_steps = RECONSTRUCT_STEPS if on else 0
        if not isinstance(self.compensate, bool):
            raise ConfigError(expected("compensate as true or false", self.compensate))
        if self.ffn is None:
            self.ffn = default_ffn(ratio, allocation=self.allocation, d=self.d, calibrated=self.calibration is not None)
        if self.ffn not in FFN_METHODS:
            raise ConfigError(expected(f"ffn in {FFN_METHODS}", self.ffn))

    def _check_storage(self) -> None:
        if self.dtype is not None:
            check_storage(self.dtype, self.group_size)
        elif self.group_size is not None:
            raise ConfigError("--group-size applies to integer storage: give --dtype int8 or int4 with it")
        if self.device is not None:
            check_device(self.device)

    def _check_scales(self) -> None:
        if not isinstance(self.keep_last_attention_output, bool):
            raise ConfigError(expected("keep_last_attention_output as true or false",
                                       self.keep_last_attention_output))
        for name in ("embedding_rank_scale", "last_block_rank_scale"):
            scale = getattr(self, name)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 16:
                raise ConfigError(expected(f"{name} as a number in (0, 16]", scale))

    def _check_calibration(self) -> None:
        if self.calibration is None:
            return
        if not isinstance(self.calibration, str) or not self.calibration:
            raise ConfigError(expected("calibration as a data source (a path, dataset name, english or "
                                       "python-stdlib)", self.calibration))
        from ..text import check_source, read_for

        with read_for(CALIBRATION_OPTION):  # a missing file refused here, not after the model has loaded
            check_source(self.calibration)

    def _check_patterns(self) -> None:
        for name in ("targets", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = [value]
            if value is not None and not all(isinstance(p, str) and p for p in value):
                raise ConfigError(expected(f"{name} as a list of module-name patterns", value))
            setattr(self, name, list(value) if value else None)

    def _check_learned(self) -> None:
        steps, scales = self.learning_steps, self.rank_scales
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(expected("learning_steps as a positive whole number", steps))
        if self.allocation == "learned" and scales is None and self.d != 1:
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

    def _check_reconstruction(self) -> None:
        steps, lr = self.reconstruct_steps, self.reconstruct_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ConfigError(expected("reconstruct_lr as a positive number", lr))
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(expected("reconstruct_steps as a whole number of steps (0: off)", steps))
        if steps and self.calibration is not None and self.fewest_sequences < RECONSTRUCTION_MIN_SEQUENCES:
            raise ConfigError(f"reconstruction holds out {RECONSTRUCTION_HELD_OUT} calibration sequences to check "
                              f"each block and trains on the rest: give at least {RECONSTRUCTION_MIN_SEQUENCES} "
                              f"(--calibration-sequences {self.calibration_sequences})")

    def for_model(self, model) -> "ConvertOptions":
        """These options with DEPENDENT_DEFAULTS chosen for ``model``'s shape: by how hard the ratio
        cuts its factorized layers. What was given stays as given."""
        if self.rank is not None:
            return self
        from .regime import layers_cut

        cut = layers_cut(model, self.ratio, d=self.d, targets=self.targets, exclude=self.exclude,
                         codebook=self.word_embedding == "codebook", codebook_width=self.codebook_width)
        return self.replace(layers_cut=cut)

    def replace(self, **changes) -> "ConvertOptions":
        """These options with ``changes`` (and ``layers_cut``), the defaults that follow others
        chosen again for the new values (``dataclasses.replace`` would keep the old choices)."""
        return dataclasses.replace(self, **{**self.defaulted(), **changes})

    def chosen_by_default(self, name: str) -> bool:
        """Whether the option ``name`` (one of DEPENDENT_DEFAULTS) was left to its default."""
        return name in self._defaulted

    def defaulted(self) -> dict:
        """The options of DEPENDENT_DEFAULTS that the defaults filled in, each None: passed to the
        constructor, they are chosen again."""
        return {name: None for name in self._defaulted}

    def reconstruct_steps_for(self, block_params: int) -> int:
        """Reconstruction steps for blocks of ``block_params`` dense parameters: those given; by
        default at most what RECONSTRUCTION_STEP_BUDGET buys the compressed block (``block_params``
        over the layers' cut), never under MIN_RECONSTRUCT_STEPS."""
        steps = self.reconstruct_steps
        if not steps or "reconstruct_steps" not in self._defaulted or not self.cut:
            return steps
        compressed = block_params / self.cut  # 0 where the ratio is out of reach (the allocation says so)
        if steps * compressed <= RECONSTRUCTION_STEP_BUDGET:
            return steps
        return max(MIN_RECONSTRUCT_STEPS, int(RECONSTRUCTION_STEP_BUDGET / compressed))

    def learning_steps_for(self, params: int) -> int:
        """The learned allocation's steps for a model of ``params`` parameters: those given; by
        default what LEARNING_STEP_BUDGET buys it, LEARNING_STEPS at most, MIN_LEARNING_STEPS at least."""
        if self.learning_steps is not None:
            return self.learning_steps
        return max(MIN_LEARNING_STEPS, min(LEARNING_STEPS, LEARNING_STEP_BUDGET // max(1, params)))

    @property
    def fewest_sequences(self) -> int:
        """The fewest calibration sequences any model gets with these options (``sequences_for``)."""
        return self.calibration_sequences or DEFAULT_SEQUENCES

    def sequences_for(self, params: int) -> int:
        """Calibration sequences for a model of ``params`` parameters: those given; where
        compensating, as many as CALIBRATION_PARAM_TOKENS buy (DEFAULT_SEQUENCES to
        MAX_CALIBRATION_SEQUENCES); else DEFAULT_SEQUENCES."""
        if self.calibration_sequences is not None:
            return self.calibration_sequences
        if not self.compensate:
            return DEFAULT_SEQUENCES
        affordable = CALIBRATION_PARAM_TOKENS // max(1, params * self.calibration_seq_len)
        return max(DEFAULT_SEQUENCES, min(MAX_CALIBRATION_SEQUENCES, affordable))

    @classmethod
    def from_dict(cls, data: dict, origin: str = "options") -> "ConvertOptions":
        """Options from a mapping (a recipe's), listing the valid keys on a typo."""
        return from_mapping(cls, data, origin)

    def to_dict(self) -> dict:
        """The options as a plain mapping (what a recipe and the report hold)."""
        return asdict(self)


def check_device(name: str) -> None:
    """Refuse a device torch does not know, or a CUDA device this machine lacks, in one line."""
    import torch

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
