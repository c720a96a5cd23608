"""Alternating least squares (ALS) for ttm-layout cores on a weighted objective.

The data-aware objective of a layer is ||S (M - M_tt)||_F^2 = tr((M - M_tt)^T G (M - M_tt)), with
G = S^T S the Gram matrix of the layer's inputs over M's rows. In the tt layout a closed form
reaches its optimum (``weighted.whitened_tt_cores``); in the ttm layout every core holds an input
mode and G does not factor over the modes, so TTM-SVD can only weight rows (``scaled_ttm_cores``).
ALS takes those cores and improves them one at a time: with the others fixed, M_tt is linear in
core k (M_tt = A_k(core k)), and the best core k solves the normal equations
A_k^* G A_k x = A_k^* G M, a positive semi-definite system solved matrix-free by a few
conjugate-gradient steps warm-started at the current core (each step builds one R x C matrix and
multiplies it by G; forming the system would take (r m r')^2 entries: 10 GB for a middle core at
MiniLM's --ratio 4 ranks). Conjugate gradients lower the objective at every step, so the result
is no worse than its start.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError, expected
from .decompose import decomposition_dtype
from .spec import TTSpec

# One sweep (cores 1..d, then back to 2) of eight CG steps each: most of what more sweeps and steps
# reach, at a fraction of their time (docs/findings.md).
SWEEPS = 1
CG_STEPS = 8


def _left_chain(cores: list[torch.Tensor], k: int) -> torch.Tensor:
    """The cores before k contracted: (rows of modes < k, columns of modes < k, r_{k-1})."""
    chain = cores[0].new_ones(1, 1, 1)
    for core in cores[:k]:
        r, m, n, r_next = core.shape
        chain = torch.einsum("pqa,aijb->piqjb", chain, core).reshape(chain.shape[0] * m, chain.shape[1] * n, r_next)
    return chain


def _right_chain(cores: list[torch.Tensor], k: int) -> torch.Tensor:
    """The cores after k contracted: (r_k, rows of modes > k, columns of modes > k)."""
    chain = cores[0].new_ones(1, 1, 1)
    for core in reversed(cores[k + 1:]):
        r, m, n, _ = core.shape
        chain = torch.einsum("aijb,bst->aisjt", core, chain).reshape(r, m * chain.shape[1], n * chain.shape[2])
    return chain


class _CoreMap:
    """M_tt as a linear map of core k (the others fixed), and its adjoint."""

    def __init__(self, cores: list[torch.Tensor], k: int, shape: tuple[int, int]):
        self.left, self.right, self.shape = _left_chain(cores, k), _right_chain(cores, k), shape
        _, self.m, self.n, _ = cores[k].shape

    def __call__(self, core: torch.Tensor) -> torch.Tensor:
        return torch.einsum("pqa,aijb,bst->pisqjt", self.left, core, self.right).reshape(self.shape)

    def adjoint(self, matrix: torch.Tensor) -> torch.Tensor:
        p, q, _ = self.left.shape
        _, s, t = self.right.shape
        blocks = matrix.reshape(p, self.m, s, q, self.n, t)
        return torch.einsum("pqa,pisqjt,bst->aijb", self.left, blocks, self.right)


def _weigh(gram: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """G @ matrix, for a full Gram matrix or a diagonal one given as a vector."""
    return gram[:, None] * matrix if gram.dim() == 1 else gram @ matrix


def weighted_error(matrix: torch.Tensor, approximation: torch.Tensor, gram: torch.Tensor) -> float:
    """||S (M - M_tt)|| / ||S M|| with S^T S = G: the relative error on the inputs G came from."""
    error = matrix - approximation
    return float(((error * _weigh(gram, error)).sum() / (matrix * _weigh(gram, matrix)).sum()).clamp_min(0).sqrt())


def _solve_core(core_map: _CoreMap, start: torch.Tensor, rhs: torch.Tensor, gram: torch.Tensor,
                steps: int) -> torch.Tensor:
    """A few conjugate-gradient steps on A^* G A x = rhs from ``start``."""
    def normal(x):
        return core_map.adjoint(_weigh(gram, core_map(x)))

    x = start
    residual = rhs - normal(x)
    direction = residual.clone()
    norm = (residual * residual).sum()
    for _ in range(steps):
        bent = normal(direction)
        curvature = (direction * bent).sum()
        if float(curvature) <= 0 or float(norm) == 0:
            break  # converged, or a direction the weights cannot see (padding rows)
        step = norm / curvature
        x = x + step * direction
        residual = residual - step * bent
        new_norm = (residual * residual).sum()
        direction = residual + (new_norm / norm) * direction
        norm = new_norm
    return x


def als_refine(matrix: torch.Tensor, cores: list[torch.Tensor], spec: TTSpec, gram: torch.Tensor,
               sweeps: int = SWEEPS, steps: int = CG_STEPS) -> list[torch.Tensor]:
    """ttm cores (r, m, n, r') of ``spec`` refined to lower tr((M - M_tt)^T G (M - M_tt)).

    ``matrix`` is M padded to the spec's padded shape (R x C); ``gram`` is G (R x R, zero over
    padding rows) or its diagonal (R weights, as for token frequencies). Cores come back in the
    dtype they came in.
    """
    if spec.layout != "ttm":
        raise ShapeError(expected("a ttm-layout spec", spec.layout))
    shape = (spec.padded_rows, spec.padded_cols)
    if tuple(matrix.shape) != shape:
        raise ShapeError(expected(f"a padded {shape[0]} x {shape[1]} matrix", tuple(matrix.shape)))
    if tuple(gram.shape) not in ((shape[0], shape[0]), (shape[0],)):
        raise ShapeError(expected(f"a {shape[0]} x {shape[0]} Gram matrix (or its diagonal)", tuple(gram.shape)))
    dtype = cores[0].dtype
    work_dtype = decomposition_dtype(dtype)
    cores = [c.detach().to(work_dtype) for c in cores]
    matrix, gram = matrix.to(work_dtype), gram.to(work_dtype)
    target = _weigh(gram, matrix)
    d = len(cores)
    order = list(range(d)) + list(range(d - 2, 0, -1))  # there and back
    for _ in range(sweeps):
        for k in order:
            core_map = _CoreMap(cores, k, shape)
            cores[k] = _solve_core(core_map, cores[k], core_map.adjoint(target), gram, steps)
    return [c.to(dtype).contiguous() for c in cores]
