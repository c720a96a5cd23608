"""ConvertOptions: every conversion option, validated on construction (also what recipes hold)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, asdict, dataclass

from ..choices import ALLOCATIONS, WORD_EMBEDDINGS
from ..errors import ConfigError, expected
from ..option_files import from_mapping
from ..tt.spec import LAYOUTS
from .calibration import BATCH as CALIBRATION_BATCH, CALIBRATION_OPTION, DEFAULT_SEQUENCES
from .storage import check_storage

# With a codebook word table (the default with --ratio), compensation and reconstruction (and
# with them the calibration's size) follow how hard the ratio cuts the model's factorized layers
# (``regime.layers_cut``), not the ratio itself: all-MiniLM-L6-v2, where they
# were measured, keeps half its weights in a word table a codebook shrinks 14x, so its other
# layers are cut 1.05x at --ratio 2, 1.63x at --ratio 3 and 2.28x at --ratio 4; a 768-wide encoder
# (bert-base's shape) 1.62x at --ratio 2 and 3.36x at --ratio 4. The threshold sits between the
# cuts of the MiniLM ratios it was measured at, so a model gets what MiniLM got where its layers
# are cut as hard. With a TT table every layer is factorized and the cut is about the ratio: the
# defaults follow the ratio as they were measured with TT tables (the *_FROM_RATIO thresholds).
#
# Modes per side with a codebook table and the tt layout: one (a plain low-rank factorization,
# whitened by the calibration) at every cut measured. all-MiniLM-L6-v2, share of dense recall@1
# kept / mean cosine on held-out english / code / man / Debian pairs (BENCHMARKS.md, Defaults by
# the layers' cut): --ratio 2 (cut 1.05x) one mode 0.952 / 0.952 / 0.996 / 0.970, cosine 0.941 /
# 0.929 / 0.937 / 0.937, three 0.944 / 0.857 / 0.977 / 0.985, cosine 0.933 / 0.918 / 0.926 / 0.927;
# --ratio 3 (1.63x, compensating) one mode 0.912 / 0.810 / 0.912 / 0.881, cosine 0.824 / 0.754 /
# 0.746 / 0.759, two 0.904 / 0.714 / 0.935 / 0.907, cosine 0.798 / 0.727 / 0.712 / 0.731, three
# 0.876 / 0.857 / 0.950 / 0.892, cosine 0.796 / 0.718 / 0.709 / 0.723. At --ratio 4 one mode keeps
# about what two keep right after conversion and trains better: 30 minutes of
# recipes/train-minilm-distill.yaml end at held-out loss 0.568 against 0.651 (3963 steps against
# 3663: two matrix products per layer instead of a contraction), recall@1 kept 0.94 / 0.76 / 0.94
# / 0.92 against 0.91 / 0.62 / 0.93 / 0.87 (BENCHMARKS.md, Recovery in CPU minutes); at --ratio 8
# (reconstruction on) two modes keep less cosine on every domain: 0.513 / 0.415 / 0.381 / 0.392
# against 0.534 / 0.437 / 0.407 / 0.421 (BENCHMARKS.md, Conversion where the linears carry the
# cut). A TT table (whose frequent-first rows need modes to sit in the leading slices) and a ttm
# layout (which needs two or more) follow the ratio: three below TWO_MODES_FROM_RATIO, two from
# it, one from ONE_MODE_FROM_RATIO with the tt layout (MiniLM with a TT table: at --ratio 4 two
# modes kept 0.49 / 0.38 / 0.62 / 0.61 against three's 0.43 / 0.33 / 0.46 / 0.53, at --ratio 2
# three the more; BENCHMARKS.md, Quality). A fixed --rank keeps CoMERA's three.
TWO_MODES_FROM_RATIO = 3.0
ONE_MODE_FROM_RATIO = 4.0
# Error compensation (with reconstruction, where it is on) pays where the compression error is
# large: all-MiniLM-L6-v2 at --ratio 4 kept 0.72-0.74 of dense recall@1 on three natural-language
# domains instead of 0.49-0.62 (BENCHMARKS.md, Conversion routes side by side); at --ratio 3 (cut
# 1.63x, as a bert-base's at --ratio 2) 0.912 / 0.810 / 0.912 / 0.881, cosine 0.824 / 0.754 / 0.746
# / 0.759, against 0.795 / 0.762 / 0.844 / 0.832, cosine 0.694 / 0.606 / 0.627 / 0.638 without
# (three modes, 128 sequences: what a bert-base got at --ratio 2 before); at --ratio 2 (cut 1.05x,
# one mode) it lost cosine on every domain, 0.924 / 0.907 / 0.915 / 0.918 against 0.941 / 0.929 /
# 0.937 / 0.937 (BENCHMARKS.md, Defaults by the layers' cut). With reconstruction (its step
# budget) and the english+python-stdlib calibration it gains there too: --ratio 2 1.004 / 0.905 /
# 0.966 / 0.985, cosine 0.952 / 0.967 / 0.956 / 0.955, against 0.952 / 0.952 / 0.992 / 0.978,
# cosine 0.944 / 0.950 / 0.950 / 0.949; --ratio 2.5 (cut 1.33x) 0.924 / 0.857 / 0.992 / 0.955,
# cosine 0.897 / 0.933 / 0.902 / 0.904, against 0.892 / 0.905 / 0.947 / 0.918, cosine 0.837 /
# 0.853 / 0.849 / 0.847 (BENCHMARKS.md, Compensation at every cut). So with a codebook table it
# is on wherever the ratio cuts the factorized layers at all (MiniLM from --ratio 1.92, a
# bert-base from 1.25); with a TT table from COMPENSATE_FROM_RATIO (MiniLM with a TT table at
# --ratio 2: 0.81-0.85 kept instead of 0.84-0.86).
COMPENSATE_ABOVE_CUT = 1.0
COMPENSATE_FROM_RATIO = 3.0
# The options whose defaults depend on others (the ratio, the table, the model's cut): chosen
# again when those change (``replace``, ``for_model``).
DEPENDENT_DEFAULTS = ("d", "compensate", "reconstruct_steps")
# Reconstruction's steps a block where it is on by default, as many as RECONSTRUCTION_STEP_BUDGET
# allows. all-MiniLM-L6-v2 calibrated on english+python-stdlib (the default), share of dense
# recall@1 kept / mean cosine on held-out english / code / man / Debian pairs: --ratio 4 (205
# steps) 0.863 / 0.952 / 0.931 / 0.881, cosine 0.810 / 0.874 / 0.798 / 0.800, with 100 steps 0.867 /
# 0.952 / 0.935 / 0.854, cosine 0.793 / 0.860 / 0.780 / 0.784; --ratio 8 (300 steps) 0.811 / 0.810 /
# 0.866 / 0.854, cosine 0.704 / 0.790 / 0.678 / 0.686, with 100 steps 0.755 / 0.714 / 0.874 / 0.836,
# cosine 0.689 / 0.767 / 0.653 / 0.661. Calibrated on english alone, more steps cost Debian 0.03 to
# 0.045 of recall@1 at --ratio 4 on three seeds (BENCHMARKS.md, Calibration text and reconstruction
# steps). 20 to 30 s more for MiniLM on 2 cores (110 s at --ratio 4, 101 s at --ratio 8).
RECONSTRUCT_STEPS = 300
# Reconstruction's cost grows with the compressed block: 100 steps took 11 s a block of a
# bert-base-shaped encoder at --ratio 4 (2.1 M parameters compressed) and 21 s at --ratio 2 (4.4 M),
# where the whole conversion then took 412 s on two cores (158 s without reconstruction; 317 s with
# 50 steps). By default a block gets at most this many steps x compressed parameters (100 steps of
# 1.6 M), never under MIN_RECONSTRUCT_STEPS: a bert-base 75 at --ratio 4 and 36 at --ratio 2 (within
# the five minutes); MiniLM's blocks 147 at --ratio 3, 205 at --ratio 4 and 300 from --ratio 6.
RECONSTRUCTION_STEP_BUDGET = 100 * 1_600_000
MIN_RECONSTRUCT_STEPS = 25
# Calibration sequences where compensation is on and none were asked for: more text keeps more of
# every held-out domain at both ratios measured. all-MiniLM-L6-v2 (reconstruction on), mean cosine
# of held-out english / code / man / Debian embeddings to the dense ones: --ratio 8 with 128
# sequences 0.534 / 0.437 / 0.407 / 0.421, 256 0.559 / 0.472 / 0.414 / 0.426, 512 0.588 / 0.500 /
# 0.441 / 0.466; --ratio 4 with 128 0.706 / 0.611 / 0.593 / 0.607, 512 0.750 / 0.670 / 0.644 /
# 0.660 (BENCHMARKS.md, Conversion where the linears carry the cut). The calibration's passes cost
# tokens x parameters (a bert-base-shaped encoder converts in 305 s on two cores with 160
# sequences and 650 s with 512, about 1 s a sequence), and its two streams' activations are what a
# calibrated streaming conversion holds beyond one block: a model gets the sequences (of
# calibration_seq_len tokens) this many parameter-tokens buy, between DEFAULT_SEQUENCES and
# MAX_CALIBRATION_SEQUENCES: MiniLM (22.7 M parameters) 512, a bert-base-shaped encoder (110 M)
# 144 (its conversion in 293 s with 100 reconstruction steps, 270 s with 75: within 5 minutes), a
# 1.1 B Llama 128 (its calibrated streaming peak is 0.92x its checkpoint with 128: BENCHMARKS.md,
# Streaming conversion).
CALIBRATION_PARAM_TOKENS = 144 * 128 * 110_000_000
MAX_CALIBRATION_SEQUENCES = 512
# Reconstruction holds out the last calibration batch and trains on the others.
RECONSTRUCTION_HELD_OUT = CALIBRATION_BATCH
RECONSTRUCTION_MIN_SEQUENCES = 2 * RECONSTRUCTION_HELD_OUT


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


def default_compensation(ratio: float | None, cut: float | None, *, codebook: bool) -> bool:
    """Whether a --ratio (None: a fixed --rank) compensates by default: by the factorized layers'
    ``cut`` with a codebook table, by the ratio with a TT table."""
    if ratio is None:
        return False
    return cut > COMPENSATE_ABOVE_CUT if codebook else ratio >= COMPENSATE_FROM_RATIO


@dataclass
class ConvertOptions:
    # The whole model (dense parameters included) shrinks at least this many times.
    ratio: float | None = 4.0
    # A fixed maximum rank for every converted layer instead of a ratio (CoMERA uses 30).
    rank: int | None = None
    # tt (in modes, then out modes) for linears, as CoMERA. Embeddings are tt too, where CoMERA
    # uses ttm ("ttm" here): a head tied to a tt embedding runs through its two halves (tokens x
    # rank x vocab) instead of the whole table: bert-base's rank-30 MLM step ran 1.4x (batch 8)
    # to 1.9x (batch 1) faster, its --ratio 4 batch-1 step went from 0.59x to 1.15x dense
    # (BENCHMARKS.md). Per parameter the tt table is also the closer one (MiniLM's word
    # embedding: 0.885 relative error at 0.73M parameters, ttm 0.923 at 1.1M), and with
    # calibration its middle bond takes token-frequency weights exactly (MiniLM --ratio 4:
    # embedding cosine 0.32 against 0.12 with ttm).
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
    # compound (hf/compensating.py). False: every layer fit to the dense model's inputs. None
    # (default_compensation): above COMPENSATE_ABOVE_CUT with a codebook table, from
    # COMPENSATE_FROM_RATIO with a TT table, off below and for a fixed --rank.
    compensate: bool | None = None
    # Block-wise reconstruction (hf/reconstruction.py): after the closed-form fit, each block's
    # factors, biases and norms are tuned for this many Adam steps (8 sequences each, at
    # reconstruct_lr, decayed to zero) to reproduce the dense block's outputs from the inputs the
    # compressed blocks before it give; kept only where it lowers the distance on a held-out
    # calibration batch. 0: off. None follows the cut, as compensation does: RECONSTRUCT_STEPS above
    # COMPENSATE_ABOVE_CUT, off below and for a fixed --rank.
    reconstruct_steps: int | None = None
    reconstruct_lr: float = 1e-3
    # How --ratio's budget is split: "uniform" (one shared maximum rank), "measured" (per-kind rank
    # scales searched end to end on the calibration text; conversion/experimental/measured.py) or "sensitivity"
    # (per layer, from the calibration data's error estimates; conversion/experimental/sensitivity.py). Both are experimental: neither
    # beat the shared rank out of domain after training (strategies.py).
    allocation: str = "uniform"
    # The ranks --ratio chooses are multiples of this (uniform allocation: the shared rank rounded
    # down; measured: each scaled rank to the nearest). 8 suits GPU tensor cores in bf16: on an
    # H100 a 4096x11008 layer at rank 160 ran its fwd+bwd 2.5x faster than at rank 163 (graphed;
    # float32 no different). 1 spends the whole budget, as the quality figures in BENCHMARKS.md
    # were measured.
    rank_multiple: int = 1
    # The input (word) embedding's ranks are this many times the shared rank (uniform allocation).
    # Measured on all-MiniLM-L6-v2, calibrated on english, on held-out text of three domains the
    # calibration never read (encyclopedic prose, package summaries, man pages): 1.5 raised the
    # mean cosine by 0.03 to 0.04 at --ratio 2 and 4; 2.5 and 4 starve the linears at --ratio 2
    # (BENCHMARKS.md, Quality). The embedding carries every token's meaning into mean pooling.
    embedding_rank_scale: float = 1.5
    # The layers of the last repeated block (a BERT's last encoder layer, a decoder's last layer)
    # get this many times the shared rank (uniform allocation): their error reaches the output with
    # no later layer to compensate it, and mean pooling reads it directly. all-MiniLM-L6-v2, share
    # of dense recall@1 kept / mean cosine on held-out english / code / man / Debian pairs right
    # after conversion (BENCHMARKS.md, The last block's rank): --ratio 4 at 1 0.843 / 0.619 / 0.889
    # / 0.810, cosine 0.750 / 0.670 / 0.644 / 0.660; at 1.5 0.884 / 0.714 / 0.912 / 0.840, cosine
    # 0.780 / 0.691 / 0.676 / 0.696; at 2 0.900 / 0.619 / 0.924 / 0.821, cosine 0.815 / 0.724 / 0.734
    # / 0.747 (3: 0.811 / 0.721 / 0.729 / 0.743 cosine). --ratio 8 at 1 0.671 / 0.571 / 0.763 / 0.701,
    # cosine 0.588 / 0.500 / 0.441 / 0.466; at 2 0.707 / 0.524 / 0.809 / 0.772, cosine 0.642 / 0.540 /
    # 0.496 / 0.522 (3 adds 0.006 to 0.023 of cosine, no recall@1). --ratio 2 at 1.5: cosine +0.005
    # to +0.009. More rank to the last two blocks, or to the first and the last, kept less. 1: one
    # shared rank everywhere. Measured on MiniLM only (its last block holds a sixth of the linears).
    # A fixed --rank and the experimental allocations do not read it.
    last_block_rank_scale: float = 2.0
    # The last repeated block's attention output projection (BERT's attention.output.dense, GPT-2's
    # attn.c_proj, Llama's self_attn.o_proj) stays dense (uniform allocation, either scale): in
    # all-MiniLM-L6-v2 at --ratio 8, putting the dense weight back into one layer of the last block,
    # or into one block's attention output, at a time moved english recall@1 by at most 0.02 save
    # this layer, which alone lifted it from 0.707 to 0.783 (BENCHMARKS.md, The last block's
    # attention output). Converted with it kept dense, share of dense recall@1 kept / mean cosine on
    # held-out english / code / man / Debian: --ratio 8 0.771 / 0.524 / 0.828 / 0.828, cosine 0.724 /
    # 0.612 / 0.598 / 0.630 (0.707 / 0.524 / 0.809 / 0.772, cosine 0.642 / 0.540 / 0.496 / 0.522
    # without); --ratio 6 0.823 / 0.571 / 0.912 / 0.810, cosine 0.769 / 0.660 / 0.661 / 0.682 (0.775 /
    # 0.571 / 0.844 / 0.739, cosine 0.699 / 0.595 / 0.567 / 0.599); at --ratio 4 and below the doubled
    # rank already leaves it dense. It costs one square matrix (0.5 % of a bert-base, 0.7 % of
    # MiniLM). Measured on MiniLM only.
    keep_last_attention_output: bool = True
    # The input (word) embedding as "tt" (as the other embeddings, by embedding_layout) or as a
    # "codebook": product-quantized (codebook/), each row one byte per slice of codebook_width
    # columns, naming one of 256 shared centres per slice. A TT over token ids keeps the rows of the
    # few most frequent tokens; a codebook keeps every row coarsely, and what it saves goes to the
    # linears. all-MiniLM-L6-v2, share of dense recall@1 kept on held-out english / code / man /
    # Debian pairs: --ratio 4 TT table 0.72 / 0.52 / 0.73 / 0.74, codebook 0.84 / 0.57 / 0.84 / 0.80;
    # --ratio 2 TT table 0.84 / 0.71 / 0.86 / 0.84, codebook 0.94 / 0.86 / 0.96 / 0.97 (BENCHMARKS.md,
    # Conversion routes side by side). None: codebook with a --ratio (uniform allocation), tt with a
    # fixed --rank (CoMERA's layout). A head tied to the table (GPT-2's lm_head, BERT-MLM's decoder)
    # multiplies by the same codebook rows.
    word_embedding: str | None = None
    # Columns per codebook slice. MiniLM at --ratio 4, recall@1 kept on english / code / man / Debian
    # (an early study that gave the linears less than the table saved): 0.80 / 0.52 / 0.79 / 0.76
    # at 4, 0.77 / 0.52 / 0.79 / 0.75 at 3, 0.76 / 0.62 / 0.76 / 0.75 at 8.
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
        for name in ("layout", "embedding_layout"):
            if getattr(self, name) not in LAYOUTS:
                raise ConfigError(expected(f"{name} in {LAYOUTS}", getattr(self, name)))
        ttm = "ttm" in (self.layout, self.embedding_layout)
        if self.word_embedding is None:
            self.word_embedding = "codebook" if self.rank is None and self.allocation == "uniform" else "tt"
        codebook = self.word_embedding == "codebook"
        self._defaulted = frozenset(name for name in DEPENDENT_DEFAULTS if getattr(self, name) is None)
        ratio = self.ratio if self.rank is None else None  # None: a fixed --rank
        self.cut = None if ratio is None else layers_cut if layers_cut is not None else ratio
        if self.d is None:
            self.d = default_modes(ratio, codebook=codebook, ttm=ttm)
        if self.d not in (1, 2, 3, 4):
            raise ConfigError(expected("d (modes per side) in (1, 2, 3, 4)", self.d))
        if self.d == 1 and ttm:
            raise ConfigError("--modes 1 is a plain low-rank factorization (truncated SVD: one core per "
                              "side), which needs the tt layout: a one-mode ttm is the dense matrix itself "
                              f"(got layout {self.layout}, embedding_layout {self.embedding_layout})")
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
        if self.rank_multiple != 1 and self.rank is not None:
            raise ConfigError(f"rank_multiple rounds the ranks a --ratio budget chooses; a fixed --rank "
                              f"{self.rank} is used as given")
        if self.rank_multiple != 1 and self.allocation == "sensitivity":
            raise ConfigError("rank_multiple applies to the uniform and measured allocations; the "
                              "sensitivity allocation climbs its own ladder of ranks")
        if self.word_embedding not in WORD_EMBEDDINGS:
            raise ConfigError(expected(f"word_embedding in {WORD_EMBEDDINGS}", self.word_embedding))
        if self.word_embedding == "codebook" and self.allocation != "uniform":
            raise ConfigError(f"a codebook word embedding works with the uniform allocation, not "
                              f"{self.allocation!r}: give --word-embedding tt for it")
        width = self.codebook_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ConfigError(expected("codebook_width as a positive integer (columns per slice)", width))
        compensating = default_compensation(ratio, self.cut, codebook=codebook)
        if self.compensate is None:
            self.compensate = compensating
        if self.reconstruct_steps is None:  # on where compensation is, given the sequences it holds out
            on = compensating and self.fewest_sequences >= RECONSTRUCTION_MIN_SEQUENCES
            self.reconstruct_steps = RECONSTRUCT_STEPS if on else 0
        if not isinstance(self.compensate, bool):
            raise ConfigError(expected("compensate as true or false", self.compensate))
        if self.dtype is not None:
            check_storage(self.dtype, self.group_size)
        elif self.group_size is not None:
            raise ConfigError("--group-size applies to integer storage: give --dtype int8 or int4 with it")
        if self.device is not None:
            check_device(self.device)
        self._check_reconstruction()
        if not isinstance(self.keep_last_attention_output, bool):
            raise ConfigError(expected("keep_last_attention_output as true or false",
                                       self.keep_last_attention_output))
        for name in ("embedding_rank_scale", "last_block_rank_scale"):
            scale = getattr(self, name)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 16:
                raise ConfigError(expected(f"{name} as a number in (0, 16]", scale))
        if self.calibration is not None and (not isinstance(self.calibration, str) or not self.calibration):
            raise ConfigError(expected("calibration as a data source (a path, dataset name, english or "
                                       "python-stdlib)", self.calibration))
        if self.calibration is not None:
            from ..text import check_source, read_for

            with read_for(CALIBRATION_OPTION):  # a missing file refused here, not after the model has loaded
                check_source(self.calibration)
        for name in ("targets", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = [value]
            if value is not None and not all(isinstance(p, str) and p for p in value):
                raise ConfigError(expected(f"{name} as a list of module-name patterns", value))
            setattr(self, name, list(value) if value else None)

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

    def defaulted(self) -> dict:
        """The options of DEPENDENT_DEFAULTS that the defaults filled in, each None: passed to the
        constructor, they are chosen again."""
        return {name: None for name in self._defaulted}

    def reconstruct_steps_for(self, block_params: int) -> int:
        """Reconstruction steps for blocks of ``block_params`` dense parameters: those asked for; by
        default at most what RECONSTRUCTION_STEP_BUDGET buys the compressed block (``block_params``
        over the layers' cut), never under MIN_RECONSTRUCT_STEPS."""
        steps = self.reconstruct_steps
        if not steps or "reconstruct_steps" not in self._defaulted or not self.cut:
            return steps
        compressed = block_params / self.cut  # 0 where the ratio is out of reach (the allocation says so)
        if steps * compressed <= RECONSTRUCTION_STEP_BUDGET:
            return steps
        return max(MIN_RECONSTRUCT_STEPS, int(RECONSTRUCTION_STEP_BUDGET / compressed))

    @property
    def fewest_sequences(self) -> int:
        """The fewest calibration sequences any model gets with these options (``sequences_for``)."""
        return self.calibration_sequences or DEFAULT_SEQUENCES

    def sequences_for(self, params: int) -> int:
        """Calibration sequences for a model of ``params`` parameters: those asked for; where
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
        return from_mapping(cls, data, origin)

    def to_dict(self) -> dict:
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
