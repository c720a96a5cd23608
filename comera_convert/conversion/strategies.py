"""Rank allocation strategies: how a ``--ratio`` budget is split between the converted layers.

A strategy takes an ``AllocationRequest`` and returns an ``Allocation``: one spec per candidate
(None keeps it dense), the shared maximum rank where there is one, and what the report says.
``uniform`` (one shared rank, the largest the ratio allows, scaled for the input embedding and the
last block, whose attention output projection stays dense) is the default, what the quality figures
are measured with; ``learned`` re-splits
its budget between the block stack's linears by ranks learned end to end (``learned.py``); the
experimental ones (``conversion/experimental/``) are opt-in studies that did not beat it out of
domain after training (their docstrings say by how much). A new strategy is a function registered in ``STRATEGIES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..errors import ConfigError
from .allocate import LayoutChoice, allocate_ranks
from .calibration import Calibration
from .experimental.measured import allocate_measured
from .experimental.sensitivity import allocate_by_sensitivity
from .learned import STEP_SEQUENCES, LearnedRanks, learn_rank_scales
from .plan import ConvertPlan
from .targets import Candidate, attention_output_in, find_blocks, last_block_prefix


@dataclass
class AllocationRequest:
    model: nn.Module
    candidates: list[Candidate]
    params_before: int
    options: ConvertPlan
    choice: LayoutChoice
    calibration: Calibration | None
    # Converts a copy with trial specs (strategies that measure conversions end to end).
    swap_in: Callable[[nn.Module, list[Candidate], list], None]
    progress: Callable[[str, int, int], None] | None = None


@dataclass
class Allocation:
    specs: list
    shared_rank: int | None
    description: str  # the report's "allocation" entry
    extra: dict = field(default_factory=dict)


def uniform(request: AllocationRequest) -> Allocation:
    """One shared maximum rank, the largest the ratio allows; the input embedding gets
    ``embedding_rank_scale`` times it, the layers of the last repeated block ``last_block_rank_scale``
    times it, and that block's attention output projection stays dense where
    ``keep_last_attention_output`` asks; left-over budget lifts the largest layers one rank."""
    plan = _uniform_plan(request)
    specs, shared_rank = allocate_ranks(request.candidates, request.params_before, request.options.ratio,
                                        request.choice, plan.scale)
    return Allocation(specs, shared_rank, plan.description, plan.extra)


UNIFORM_DESCRIPTION = "uniform: one shared maximum rank"


@dataclass
class _UniformPlan:
    scale: Callable | None  # the per-layer rank scale (None: one shared rank)
    description: str
    extra: dict
    kept_dense: str | None

    def rank_scale(self, candidate: Candidate) -> float | None:
        """The candidate's multiple of the shared rank (None: it stays dense)."""
        return 1.0 if self.scale is None else self.scale(candidate)


def _uniform_plan(request: AllocationRequest) -> _UniformPlan:
    """The uniform allocation's per-layer scales and what its report says of them."""
    options = request.options
    scaled = options.last_block_rank_scale != 1
    last_block = last_block_prefix(request.model) if scaled or options.keep_last_attention_output else None
    kept_dense = (attention_output_in([c.name for c in request.candidates], last_block)
                  if last_block is not None and options.keep_last_attention_output else None)
    scale = _uniform_scales(request.model, options.embedding_rank_scale, last_block if scaled else None,
                            options.last_block_rank_scale, kept_dense)
    description, extra = UNIFORM_DESCRIPTION, {}
    if last_block is not None and scaled:
        description += f", the last block's layers at {options.last_block_rank_scale:g}x it"
        extra["last_block_rank_scale"] = options.last_block_rank_scale
    if kept_dense is not None:
        description += f", {kept_dense} (the last block's attention output) dense"
        extra["dense_last_attention_output"] = kept_dense
    return _UniformPlan(scale, description, extra, kept_dense)


def learned(request: AllocationRequest) -> Allocation:
    """The uniform allocation with the linears of the block stack but the last block at learned
    multiples of the shared rank (``options.rank_scales``; learned here from the calibration's probe
    sequences where none were given: ``learn_allocation``); the shared rank is then the largest that
    meets the ratio."""
    options = request.options
    plan = _uniform_plan(request)
    scales, extra = options.rank_scales, {}
    if scales is None:
        learning = learn_allocation(request, probe_batches(_needs_calibration(request)))
        scales, extra = learning.scales, learning.to_dict()
    unknown = sorted(set(scales) - {c.name for c in request.candidates if c.kind == "linear"})
    if unknown:
        raise ConfigError(f"rank_scales name {unknown[0]}, which is not a linear layer this conversion converts "
                          f"({len(unknown)} such name(s)): learn them again for this model")
    def scale(candidate: Candidate) -> float | None:
        if candidate.name == plan.kept_dense:
            return None
        return scales.get(candidate.name, plan.rank_scale(candidate))

    specs, shared_rank = allocate_ranks(request.candidates, request.params_before, options.ratio, request.choice,
                                        scale)
    description = ("learned: the ranks of every block but the last learned end to end on the calibration text"
                   + plan.description.removeprefix(UNIFORM_DESCRIPTION))
    return Allocation(specs, shared_rank, description, {**plan.extra, **extra, "rank_scales": dict(scales)})


def learn_allocation(request: AllocationRequest, batches: list) -> LearnedRanks:
    """Learn the per-layer rank scales of the block stack's linears (``learned.learn_rank_scales``),
    starting from the uniform allocation of ``request`` (a dense model with its weights in memory).

    The last block's layers are not learned: they keep the uniform allocation's scale
    (``last_block_rank_scale``). The learning sees every layer's error as it is before compensation
    and reconstruction, which make up for a block's error in the blocks after it; the last block has
    none after it, and learned it lost rank to earlier blocks. On all-mpnet-base-v2 at --ratio 4
    that cost 0.02-0.04 of cosine on every held-out domain; kept at 2x, the learned allocation gains
    cosine on every domain (docs/findings.md)."""
    plan = _uniform_plan(request)
    stack = find_blocks(request.model)
    if stack is None:
        raise ConfigError("allocation 'learned' learns the ranks of a stack of repeated blocks, which this model "
                          f"({type(request.model).__name__}) lacks: use the uniform allocation")
    prefix, last_block = f"{stack}." if stack else "", last_block_prefix(request.model)
    layers = [c for c in request.candidates
              if c.kind == "linear" and c.name.startswith(prefix) and not c.name.startswith(last_block)]
    if not layers:
        raise ConfigError("allocation 'learned' found no linear layer to learn before the last block (the targets "
                          "leave none): use the uniform allocation")
    shared_rank = allocate_ranks(request.candidates, request.params_before, request.options.ratio, request.choice,
                                 plan.scale)[1]
    return learn_rank_scales(request.model, layers, {c.name: plan.rank_scale(c) for c in layers}, shared_rank, batches,
                             steps=request.options.learning_steps)


def probe_batches(calibration: Calibration) -> list:
    """The calibration's probe sequences in batches of the learning's size."""
    if calibration.probe is None or calibration.probe.shape[0] < 2 * STEP_SEQUENCES:
        raise ConfigError("allocation 'learned' needs calibration sequences to learn on: build the calibration with "
                          "calibrate(), or give rank_scales")
    return list(calibration.probe.split(STEP_SEQUENCES))


def measured(request: AllocationRequest) -> Allocation:
    calibration = _needs_calibration(request)
    if calibration.probe is None:
        raise ConfigError("allocation 'measured' needs probe sequences in the calibration: build it with "
                          "calibrate() or collect()")
    specs, scales, cosine = allocate_measured(request.model, request.candidates, request.params_before,
                                              request.options.ratio, request.choice, calibration,
                                              request.swap_in, request.progress)
    return Allocation(specs, None, "measured: per-kind rank scales searched end to end on the calibration "
                                   "sequences (experimental)",
                      {"rank_scales": {kind: round(scale, 3) for kind, scale in scales.items()},
                       "probe_cosine": round(cosine, 4)})


def sensitivity(request: AllocationRequest) -> Allocation:
    specs, estimated = allocate_by_sensitivity(request.candidates, request.params_before, request.options.ratio,
                                               request.choice, _needs_calibration(request))
    return Allocation(specs, None, "sensitivity: per-layer ranks, greedy by estimated output error removed per "
                                   "parameter on the calibration inputs (experimental)",
                      {"estimated_relative_error": {k: round(v, 4) for k, v in estimated.items()}})


STRATEGIES: dict[str, Callable[[AllocationRequest], Allocation]] = {
    "uniform": uniform, "learned": learned, "measured": measured, "sensitivity": sensitivity}


def _needs_calibration(request: AllocationRequest) -> Calibration:
    if request.calibration is None:
        raise ConfigError(f"allocation {request.options.allocation!r} needs calibration data (--calibration "
                          f"DATA, or calibration=calibrate(model, tokenizer, DATA))")
    return request.calibration


def _uniform_scales(model: nn.Module, embedding_scale: float, last_block: str | None, last_block_scale: float,
                    kept_dense: str | None = None):
    """The uniform allocation's per-layer rank scale: ``embedding_scale`` for the input embedding,
    ``last_block_scale`` for the layers under the ``last_block`` prefix (None: no block scaled), None
    (stays dense) for the layer named ``kept_dense``, 1 elsewhere (None when there is nothing to
    scale)."""
    get = getattr(model, "get_input_embeddings", None)
    words = get() if get is not None and embedding_scale != 1 else None
    if words is None and last_block is None and kept_dense is None:
        return None

    def scale(candidate) -> float | None:
        if candidate.name == kept_dense:
            return None
        if words is not None and candidate.module is words:
            return embedding_scale
        if last_block is not None and candidate.name.startswith(last_block):
            return last_block_scale
        return 1.0
    return scale
