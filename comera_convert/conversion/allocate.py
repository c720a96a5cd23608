"""Rank allocation: choose each layer's TT ranks so the whole model shrinks by a given ratio.

The ratio counts every parameter of the model, dense ones included:
    ratio = params(dense model) / params(converted model).
A single maximum rank r is shared by all converted layers (each clipped to what its shape
allows, as CoMERA uses rank 30 everywhere; a scale per layer, where given, multiplies it); r is
the largest value whose model still meets the ratio, found by bisection since the parameter count
grows with r. A table held as a codebook (``LayoutChoice.codebook``) costs the same at every r: the
budget it leaves goes to the TT layers.
A layer whose TT form at r would not be smaller than the dense one stays dense. The budget left over then
lifts the largest layers to the next rank, one at a time, while the ratio still holds. With a
rank multiple m (tensor-core friendly shapes), r and the next rank are multiples of m.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codebook import CodebookSpec
from ..errors import RatioError
from ..tt.counting import num_gate_params, num_params
from ..tt.spec import TTSpec
from .targets import Candidate


@dataclass(frozen=True)
class LayoutChoice:
    """How layers are laid out: the tt/ttm layout of linears and embeddings, modes per side, and the
    embeddings held as codebook tables instead (by name) with their slices' width."""

    linear: str = "tt"
    embedding: str = "tt"
    d: int = 3
    gates: bool = True
    rank_multiple: int = 1  # chosen ranks are multiples of this (tensor-core friendly at 8)
    codebook: frozenset[str] = frozenset()
    codebook_width: int = 4

    def rounded(self, rank: float) -> int:
        """``rank`` rounded to the nearest multiple of ``rank_multiple`` (at least one multiple)."""
        return max(1, round(rank / self.rank_multiple)) * self.rank_multiple

    def spec(self, candidate: Candidate, rank) -> TTSpec | CodebookSpec:
        if candidate.name in self.codebook:
            element_size = candidate.module.weight.element_size()
            return CodebookSpec.plan(candidate.rows, candidate.cols, self.codebook_width, element_size)
        layout = self.embedding if candidate.kind == "embedding" else self.linear
        return TTSpec.plan(candidate.rows, candidate.cols, rank, layout=layout, d=self.d)

    def stored_params(self, spec: TTSpec | CodebookSpec) -> int:
        """What a converted layer stores for its matrix: cores, plus gates when they are on (a
        codebook table: its codebooks and codes)."""
        if isinstance(spec, CodebookSpec):
            return spec.stored_params
        return num_params(spec) + (num_gate_params(spec) if self.gates else 0)


def model_params_with(candidates, specs, total_params: int, choice: LayoutChoice) -> int:
    """The model's parameter count once ``candidates`` are replaced by layers of ``specs``
    (a None spec leaves its layer dense)."""
    replaced = sum(c.dense_params for c, s in zip(candidates, specs) if s is not None)
    return total_params - replaced + sum(choice.stored_params(s) for s in specs if s is not None)


def spec_if_smaller(candidate: Candidate, rank, choice: LayoutChoice) -> TTSpec | None:
    """The layer's spec at ``rank``, or None where TT would store no fewer weights than dense."""
    spec = choice.spec(candidate, rank)
    return spec if choice.stored_params(spec) < candidate.dense_params else None


def specs_at_rank(candidates, rank: int, choice: LayoutChoice, scale=None) -> list[TTSpec | None]:
    """Every candidate's spec at ``rank``, or at scale(candidate) * rank rounded to the choice's rank
    multiple when a scale is given (a scale of None keeps that candidate dense)."""
    if scale is None:
        return [spec_if_smaller(c, rank, choice) for c in candidates]
    scales = [scale(c) for c in candidates]
    return [None if s is None else spec_if_smaller(c, choice.rounded(s * rank), choice)
            for c, s in zip(candidates, scales)]


def allocate_ranks(candidates: list[Candidate], total_params: int, ratio: float,
                   choice: LayoutChoice, scale=None) -> tuple[list[TTSpec | None], int]:
    """Specs meeting ``ratio`` with the largest shared rank (a multiple of the choice's
    ``rank_multiple``), and that rank. A layer that TT would not make smaller at that rank gets None
    (it stays dense). ``scale(candidate)``, when given, multiplies the shared rank per layer
    (``measured.py`` searches it); where it is None the layer stays dense.

    Raises RatioError, naming the largest reachable ratio, when even the smallest rank is not enough.
    """
    step = choice.rank_multiple

    def ratio_at(rank: int) -> float:
        specs = specs_at_rank(candidates, rank, choice, scale)
        return total_params / model_params_with(candidates, specs, total_params, choice)

    best = ratio_at(step)
    if best < ratio:
        raise RatioError(f"ratio {ratio:g} cannot be reached with these targets: the largest reachable "
                         f"ratio is {best:.2f} (every converted layer at rank {step})")
    planned = [choice.spec(c, 1) for c in candidates]
    high = max(1, max((max(s.max_ranks) for s in planned if isinstance(s, TTSpec)), default=1) // step)
    low = 1  # in multiples of step; invariant: ratio_at(low * step) >= ratio
    while low < high:
        mid = (low + high + 1) // 2
        if ratio_at(mid * step) >= ratio:
            low = mid
        else:
            high = mid - 1
    rank = low * step
    return _fill_towards(candidates, specs_at_rank(candidates, rank, choice, scale),
                         specs_at_rank(candidates, rank + step, choice, scale), total_params, ratio, choice), rank


def _fill_towards(candidates, specs, next_specs, total_params: int, ratio: float,
                  choice: LayoutChoice) -> list[TTSpec]:
    """Raise single layers to their ``next_specs`` (the next shared rank; largest first) while the
    model still meets the ratio, so the achieved ratio lands as close above the target ratio as one
    rank step allows."""
    specs = list(specs)
    budget = total_params / ratio - model_params_with(candidates, specs, total_params, choice)
    for i in sorted(range(len(candidates)), key=lambda i: -candidates[i].dense_params):
        grown = next_specs[i]
        if grown is None or specs[i] is None:
            continue
        extra = choice.stored_params(grown) - choice.stored_params(specs[i])
        if 0 < extra <= budget:
            specs[i] = grown
            budget -= extra
    return specs
