"""Per-layer rank allocation from calibration data: spend the ``--ratio`` budget where it buys the
most accuracy.

Each layer's relative error on its calibration inputs at a given rank is estimated with the TT-SVD
bound on the weighted matrix (the one ``calibration.weighted_decomposer`` decomposes): the squared
singular values every truncated unfolding drops, over the matrix's squared norm. Starting from
rank 1 everywhere, a greedy pass then repeatedly takes the rank step with the largest reduction of
the summed squared errors per added parameter, while the whole model still meets the ratio; the
last step of a layer is keeping it dense, which removes its error at the price of all its
parameters.

Measured on all-MiniLM-L6-v2 it keeps less than one shared rank at both ``--ratio 2`` and
``--ratio 4`` (docs/findings.md).
The weighted-energy estimate is dominated by a few outlier activation directions, so it starves
layers whose errors matter more than their estimate says, and it cannot see how errors compound
through the network. It is therefore opt-in (``allocation="sensitivity"``); the shared rank
stays the default.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ...errors import RatioError
from ...layers.tt_linear import dense_weight_of
from ...tt.decompose import interleave, padded
from ...tt.spec import TTSpec
from ..allocate import LayoutChoice, model_params_with
from ..calibration import Calibration
from ..targets import Candidate

RANK_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024)


@dataclass
class ErrorCurve:
    """The squared singular values of each unfolding of a layer's weighted tensor, descending."""

    spectra: list[torch.Tensor]
    energy: float

    def relative_error(self, spec: TTSpec) -> float:
        # The largest single bond's loss: a lower bound of the TT-SVD error that, unlike the sum of
        # all bonds' losses (an upper bound), does not saturate at low ranks.
        lost = max(float(sv[r:].sum()) for sv, r in zip(self.spectra, spec.ranks))
        return min(1.0, lost / self.energy) if self.energy > 0 else 0.0


def weighted_matrix(candidate: Candidate, calibration: Calibration) -> torch.Tensor:
    """The layer's matrix (rows = inputs / vocabulary) weighted as its decomposition weights it:
    S M for a linear (S^T S = its inputs' Gram), sqrt(counts) * M for an embedding (rows in
    ``token_order``, as the converter lays them out); unweighted for a layer the calibration
    did not reach."""
    if candidate.kind == "linear":
        matrix = dense_weight_of(candidate.module)[0].detach().to(torch.float64).T  # rows = inputs
        factor = calibration.input_factor(candidate.name)
        return matrix if factor is None else factor @ matrix
    matrix = candidate.module.weight.detach().to(torch.float64)
    weights = calibration.token_weights(candidate.name)
    return matrix if weights is None else weights[:, None] * matrix[calibration.token_order(candidate.name)]


def error_curve(weighted: torch.Tensor, spec: TTSpec) -> ErrorCurve:
    """Spectra of every bond's unfolding of ``weighted`` laid out as ``spec`` lays it out."""
    work = padded(weighted, spec)
    tensor = work.reshape(spec.bond_modes) if spec.layout == "tt" else interleave(work, spec)
    spectra, left = [], 1
    for k in range(len(spec.bond_modes) - 1):
        left *= spec.bond_modes[k]
        unfolding = tensor.reshape(left, -1)
        small = unfolding @ unfolding.T if unfolding.shape[0] <= unfolding.shape[1] else unfolding.T @ unfolding
        spectra.append(torch.linalg.eigvalsh(small).flip(0).clamp_min(0))
    return ErrorCurve(spectra, float(work.square().sum()))


def allocate_by_sensitivity(candidates: list[Candidate], total_params: int, ratio: float, choice: LayoutChoice,
                            calibration: Calibration) -> tuple[list[TTSpec | None], dict[str, float]]:
    """Per-layer specs (None = stays dense) meeting ``ratio``, and each layer's estimated relative
    error on its calibration inputs."""
    budget = total_params / ratio
    curves = [error_curve(weighted_matrix(c, calibration), choice.spec(c, 1 << 20)) for c in candidates]
    ladders = [_ladder(c, choice) for c in candidates]
    level = [0] * len(candidates)
    specs = [ladder[0] for ladder in ladders]
    if model_params_with(candidates, specs, total_params, choice) > budget:
        best = total_params / model_params_with(candidates, specs, total_params, choice)
        raise RatioError(f"ratio {ratio:g} cannot be reached with these targets: the largest reachable "
                         f"ratio is {best:.2f} (every converted layer at rank 1)")
    errors = [_error(curve, spec) for curve, spec in zip(curves, specs)]
    used = model_params_with(candidates, specs, total_params, choice)
    heap = [_step(i, ladders, level, curves, errors, candidates, choice) for i in range(len(candidates))]
    heap = [entry for entry in heap if entry is not None]
    heapq.heapify(heap)
    while heap:
        _, i, spec, error, cost = heapq.heappop(heap)
        if used + cost > budget:
            continue  # this layer's next step does not fit; smaller steps of others may
        used += cost
        level[i] += 1
        specs[i], errors[i] = spec, error
        entry = _step(i, ladders, level, curves, errors, candidates, choice)
        if entry is not None:
            heapq.heappush(heap, entry)
    return specs, {c.name: errors[i] for i, c in enumerate(candidates)}


def _ladder(candidate: Candidate, choice: LayoutChoice) -> list[TTSpec | None]:
    """The layer's distinct specs by growing rank while TT stays smaller than dense, then dense (None)."""
    ladder, seen = [], set()
    for rank in RANK_LADDER:
        spec = choice.spec(candidate, rank)
        if choice.stored_params(spec) >= candidate.dense_params:
            break
        if spec.ranks not in seen:
            seen.add(spec.ranks)
            ladder.append(spec)
    return ladder + [None] if ladder else [None]


def _error(curve: ErrorCurve, spec: TTSpec | None) -> float:
    return 0.0 if spec is None else curve.relative_error(spec)


def _stored(candidate: Candidate, spec: TTSpec | None, choice: LayoutChoice) -> int:
    return candidate.dense_params if spec is None else choice.stored_params(spec)


def _step(i, ladders, level, curves, errors, candidates, choice):
    """The heap entry for layer i's next rank step: (-gain per parameter, i, spec, error, cost)."""
    if level[i] + 1 >= len(ladders[i]):
        return None
    current, nxt = ladders[i][level[i]], ladders[i][level[i] + 1]
    cost = _stored(candidates[i], nxt, choice) - _stored(candidates[i], current, choice)
    error = _error(curves[i], nxt)
    gain = errors[i] ** 2 - error ** 2  # squared: a large error in one layer costs more than several small ones
    return (-gain / max(cost, 1), i, nxt, error, cost)
