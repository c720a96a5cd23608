"""plan(request, model): the one place a conversion's defaults are derived.

A request (``request.py``) holds what the user gave; every field it leaves ``None`` is chosen here, from
the request and the model's shape, once: the word table, the modes, how hard the ratio cuts the factorized
layers, compensation, reconstruction, the feed-forward pairs' handling and the counts that follow the
model's size. The frozen ``ConvertPlan`` carries each choice with its one-line reason; the checkpoint's
report stores it and ``comera report`` prints it. The stages read the plan and never fill in a default.

With a codebook word table (the default with --ratio), compensation, reconstruction and the
calibration's size follow how hard the ratio cuts the factorized layers (``regime.layers_cut``), not
the ratio: a model gets what MiniLM got where its layers are cut as hard. With a TT table every
layer is factorized, so the defaults follow the ratio (the *_FROM_RATIO thresholds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from ..errors import ConfigError
from ..option_files import GIVEN
from ..request import RECONSTRUCTION_MIN_SEQUENCES, SHARED_RANK, ConvertRequest
from .calibration import DEFAULT_SEQUENCES
from .learned import LEARNING_STEP_BUDGET, LEARNING_STEPS, MIN_LEARNING_STEPS
from .model_facts import count_params
from .regime import layers_cut
from .targets import find_blocks

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


@dataclass(frozen=True)
class ModelShape:
    """What the plan reads of a model: its parameters, its first repeated block's (None: no stack of
    blocks) and how hard the ratio cuts its factorized layers (None for a fixed rank)."""
    params: int
    cut: float | None
    block_params: int | None = None


@dataclass(frozen=True)
class ConvertPlan:
    """A request with every default chosen for one model: the derived choices are fields, each with its
    reason in ``reasons``; what the request gave is read through to it (``plan.layout`` is
    ``plan.request.layout``)."""
    request: ConvertRequest
    ratio: float | None  # the budget's ratio; None for a fixed rank, which replaces it
    word_embedding: str
    d: int
    cut: float | None
    compensate: bool
    ffn: str
    calibration_sequences: int
    reconstruct_steps: int  # per block, 0: off
    learning_steps: int
    reasons: dict = field(default_factory=dict, compare=False)

    def __getattr__(self, name: str):
        if name == "request":  # not set yet (a copy being built): no field to read through to
            raise AttributeError(name)
        return getattr(self.request, name)

    def to_dict(self) -> dict:
        """Every option as the conversion uses it: the request's fields with the derived ones chosen."""
        return {**self.request.to_dict(), **{name: getattr(self, name) for name in self.reasons}}

    def describe(self) -> dict:
        """Each derived choice as {"value", "reason"}: what the report stores and `comera report` prints."""
        def plain(value):  # JSON has no infinity: a ratio out of reach leaves the cut unknown
            return None if isinstance(value, float) and not math.isfinite(value) else value

        return {name: {"value": plain(getattr(self, name)), "reason": reason} for name, reason in self.reasons.items()}


def plan(request: ConvertRequest, model: nn.Module) -> ConvertPlan:
    """``request``'s defaults chosen for ``model``'s shape (on the meta device or in memory): the one
    place they are derived. An option the plan cannot honour is refused here, in one line."""
    table = word_table(request)[0]
    modes = choose_modes(request, table)[0]  # the cut depends on them; plan_for states them with their reasons
    return plan_for(request, model_shape(model, request, d=modes, codebook=table == "codebook"))


def model_shape(model: nn.Module, request: ConvertRequest, *, d: int, codebook: bool) -> ModelShape:
    """The facts of ``model`` the plan reads."""
    ratio = request.budget_ratio
    cut = None if ratio is None else layers_cut(model, ratio, d=d, targets=request.targets, exclude=request.exclude,
                                                codebook=codebook, codebook_width=request.codebook_width)
    blocks = find_blocks(model)
    block_params = sum(p.numel() for p in model.get_submodule(blocks)[0].parameters()) if blocks else None
    return ModelShape(params=count_params(model), cut=cut, block_params=block_params)


def plan_for(request: ConvertRequest, shape: ModelShape) -> ConvertPlan:
    """``request``'s plan for a model of ``shape`` (``plan`` measures the shape; tests give one)."""
    table = word_table(request)
    modes = choose_modes(request, table[0])
    choices = {"ratio": _ratio(request), "word_embedding": table, "d": modes}
    cut_calls_for_it = _compensation(request, shape, codebook=table[0] == "codebook")
    choices["compensate"] = (request.compensate, GIVEN) if request.compensate is not None else cut_calls_for_it
    choices["ffn"] = _ffn(request, modes[0])
    choices["calibration_sequences"] = _sequences(request, shape, choices["compensate"][0])
    choices["reconstruct_steps"] = _reconstruction(request, shape, cut_calls_for_it[0])
    choices["learning_steps"] = _learning_steps(request, shape)
    _check_learned(request, modes[0])
    values = {name: value for name, (value, _) in choices.items()}
    reasons = {name: reason for name, (_, reason) in choices.items()}
    if shape.cut is not None:
        reasons["cut"] = "the factorized layers' dense weights over what the ratio's budget leaves them"
    return ConvertPlan(request=request, cut=shape.cut, reasons=reasons, **values)


def _ratio(request: ConvertRequest) -> tuple:
    if request.rank is not None:
        return None, f"a fixed --rank {request.rank} replaces the ratio"
    return request.ratio, GIVEN


def word_table(request: ConvertRequest) -> tuple[str, str]:
    """(the input embedding's kind, why): a codebook with a --ratio's shared-rank allocations, whose
    savings go to the linears; a TT with a fixed --rank (CoMERA's) and the other allocations."""
    if request.word_embedding is not None:
        return request.word_embedding, GIVEN
    if request.rank is None and request.allocation in SHARED_RANK:
        return "codebook", f"a --ratio with the {request.allocation} allocation: the table's savings go to the linears"
    why = "a fixed --rank (CoMERA's TT)" if request.rank is not None else \
        f"the {request.allocation} allocation works with a TT table"
    return "tt", why


def choose_modes(request: ConvertRequest, table: str) -> tuple[int, str]:
    """(modes per side, why): one with a codebook table and the tt layout, at every cut measured; else
    by the ratio, two or more with a ttm layout (one ttm mode would be the dense matrix itself); CoMERA's
    three for a fixed --rank."""
    if request.d is not None:
        return request.d, GIVEN
    ratio = request.budget_ratio
    if ratio is None:
        return 3, "a fixed --rank: CoMERA's three modes per side"
    if table == "codebook" and not request.ttm:
        return 1, "a codebook table with the tt layout: one whitened truncated SVD per layer"
    if ratio < TWO_MODES_FROM_RATIO:
        return 3, f"a TT table or ttm layout below --ratio {TWO_MODES_FROM_RATIO:g}"
    if ratio >= ONE_MODE_FROM_RATIO and not request.ttm:
        return 1, f"a TT table from --ratio {ONE_MODE_FROM_RATIO:g} with the tt layout"
    return 2, f"a TT table or ttm layout from --ratio {TWO_MODES_FROM_RATIO:g}"


def _compensation(request: ConvertRequest, shape: ModelShape, *, codebook: bool) -> tuple[bool, str]:
    """Whether the cut calls for fitting the layers to the compressed layers' inputs (and for
    reconstruction, which follows the cut whether or not compensation was given): by the factorized
    layers' cut with a codebook table, by the ratio with a TT table, never for a fixed --rank."""
    if request.budget_ratio is None:
        return False, "a fixed --rank keeps the dense model's inputs"
    if codebook:
        on = shape.cut > COMPENSATE_ABOVE_CUT
        return on, f"the ratio cuts the factorized layers {shape.cut:.3g}x" + ("" if on else ": not at all")
    on = request.budget_ratio >= COMPENSATE_FROM_RATIO
    return on, f"a TT table: on from --ratio {COMPENSATE_FROM_RATIO:g}"


def _ffn(request: ConvertRequest, d: int) -> tuple[str, str]:
    """Pruned by neuron where a --ratio's uniform allocation gives the pair low-rank layers (one mode) and
    calibration text refits it, which kept more of dense recall@1 on every encoder and ratio measured;
    low-rank elsewhere (a fixed --rank, the other allocations, TT modes, an uncalibrated conversion).
    docs/findings.md"""
    if request.ffn is not None:
        return request.ffn, GIVEN
    if request.budget_ratio is not None and request.allocation == "uniform" and d == 1 and request.calibration:
        return "prune", "calibrated, one mode and the uniform allocation: whole neurons, the second layer refit"
    return "low-rank", "pruning needs calibration text, one mode, the uniform allocation and a --ratio"


def _sequences(request: ConvertRequest, shape: ModelShape, compensate: bool) -> tuple[int, str]:
    """Calibration sequences: where compensating, as many as CALIBRATION_PARAM_TOKENS buy the model
    (DEFAULT_SEQUENCES to MAX_CALIBRATION_SEQUENCES); else DEFAULT_SEQUENCES."""
    if request.calibration_sequences is not None:
        return request.calibration_sequences, GIVEN
    if not compensate:
        return DEFAULT_SEQUENCES, "the default without compensation"
    affordable = CALIBRATION_PARAM_TOKENS // max(1, shape.params * request.calibration_seq_len)
    sequences = max(DEFAULT_SEQUENCES, min(MAX_CALIBRATION_SEQUENCES, affordable))
    return sequences, f"what {CALIBRATION_PARAM_TOKENS:.3g} parameter-tokens buy {shape.params:,} parameters"


def _reconstruction(request: ConvertRequest, shape: ModelShape, cut_calls_for_it: bool) -> tuple[int, str]:
    """Reconstruction's steps a block: on where the cut calls for compensation (given the sequences it
    holds out), at most what RECONSTRUCTION_STEP_BUDGET buys the compressed block, never under
    MIN_RECONSTRUCT_STEPS."""
    if request.reconstruct_steps is not None:
        return request.reconstruct_steps, GIVEN
    if not cut_calls_for_it:
        return 0, "off where the cut calls for no compensation"
    if (request.calibration_sequences or DEFAULT_SEQUENCES) < RECONSTRUCTION_MIN_SEQUENCES:
        return 0, f"off: fewer than {RECONSTRUCTION_MIN_SEQUENCES} calibration sequences to hold a batch out"
    if not shape.block_params or not shape.cut:
        return RECONSTRUCT_STEPS, "where compensating"
    compressed = shape.block_params / shape.cut  # 0 where the ratio is out of reach (the allocation says so)
    if RECONSTRUCT_STEPS * compressed <= RECONSTRUCTION_STEP_BUDGET:
        return RECONSTRUCT_STEPS, "where compensating"
    steps = max(MIN_RECONSTRUCT_STEPS, int(RECONSTRUCTION_STEP_BUDGET / compressed))
    return steps, f"what the step budget buys a compressed block of {compressed:,.0f} parameters"


def _learning_steps(request: ConvertRequest, shape: ModelShape) -> tuple[int, str]:
    """The learned allocation's steps: what LEARNING_STEP_BUDGET buys the model, LEARNING_STEPS at most,
    MIN_LEARNING_STEPS at least."""
    if request.learning_steps is not None:
        return request.learning_steps, GIVEN
    steps = max(MIN_LEARNING_STEPS, min(LEARNING_STEPS, LEARNING_STEP_BUDGET // max(1, shape.params)))
    return steps, f"what the learning budget buys {shape.params:,} parameters"


def _check_learned(request: ConvertRequest, d: int) -> None:
    if request.allocation == "learned" and request.rank_scales is None and d != 1:
        raise ConfigError(f"allocation 'learned' learns the rank of each layer's low-rank pair (--modes 1, the "
                          f"default with a codebook word table); got --modes {d}")


def finite_cut(plan: ConvertPlan) -> float | None:
    """The cut as the report records it: None for a fixed rank or a ratio out of reach."""
    return round(plan.cut, 3) if plan.cut is not None and math.isfinite(plan.cut) else None
