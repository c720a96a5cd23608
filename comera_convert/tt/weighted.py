"""Data-aware TT decompositions: minimize the error on real inputs, ||X (M - M_tt)||_F, instead of
||M - M_tt||_F.

With G = X^T X = S^T S (S the input factor, R x R), ||X (M - M_tt)|| = ||S (M - M_tt)||, so the
decomposition works on the whitened matrix S M and folds S^{-1} back into the input side.

tt layout (input modes, then output modes). Sweeping right to left, every bond on the output side
and the middle bond keep right singular vectors of an unfolding whose rows carry the input index
whole: whitening the rows leaves those projections optimal, so these truncations are exactly
the best for the weighted objective (as truncation-aware whitening is for SVD). What remains is
A = S M V, an R x r matrix; the input half is S^{-1} A, split over the input modes by TT-SVD
with its rows scaled by per-mode weights (below) that approximate sqrt(G_ii); exact whenever
those bonds are at full rank, as they are at the ranks `--ratio` conversions give at bert sizes.

ttm layout (interleaved input / output modes). S does not factor over the modes, so TTM-SVD
can only weight rows (the Gram diagonal, or token frequencies for embeddings), approximated by a
product of one weight vector per input mode; scaling rows by that product, TTM-SVD, and dividing
each core's input mode by its vector is then exact. For linear layers, alternating least squares
on the whole Gram matrix (``als``) then refines those cores, lowering the error on the inputs.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError, expected
from .als import als_refine
from .decompose import check_matrix, interleave, padded, left_singular_vectors, pad_cores, tt_svd
from .spec import TTSpec


def input_factor(gram: torch.Tensor, damping: float = 1e-4) -> tuple[torch.Tensor, float]:
    """(S, damping used): an upper-triangular S with S^T S = G, or G + damping * mean(diag G) * I
    when G is singular (from too few or degenerate inputs: a pivot below 1e-10 of the mean
    diagonal). The damping grows tenfold until the factorization succeeds; 0 means none was needed.
    """
    gram = gram.to(torch.float64)
    scale = float(gram.diagonal().mean()) or 1.0
    lower, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0 and float(lower.diagonal().square().min()) > 1e-10 * scale:
        return lower.T, 0.0
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    while True:
        lower, info = torch.linalg.cholesky_ex(gram + damping * scale * eye)
        if int(info) == 0:
            return lower.T, damping
        damping *= 10.0


def _right_sweep(tensor: torch.Tensor, ranks) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Right-to-left TT-SVD over the last len(ranks) modes of ``tensor`` (shape (N, s_1..s_k)):
    cores for s_1..s_k and the remaining N x r_0 matrix. ranks[i] is the bond left of s_{i+1}."""
    modes = tensor.shape[1:]
    cores = []
    rest = tensor.reshape(-1, modes[-1])
    r_next = 1
    for k in range(len(modes) - 1, -1, -1):
        rest = rest.reshape(-1, modes[k] * r_next)
        v = left_singular_vectors(rest.T, int(ranks[k]))  # top right singular vectors
        r = v.shape[1]
        cores.insert(0, v.T.reshape(r, modes[k], r_next))
        rest = rest if r == rest.shape[1] else rest @ v  # at full rank v is the identity: no copy
        r_next = r
    return cores, rest


def whitened_tt_cores(matrix: torch.Tensor, spec: TTSpec, factor: torch.Tensor) -> list[torch.Tensor]:
    """tt-layout cores of an R x C matrix that minimize ||S (M - M_tt)|| at the middle and output
    bonds. ``factor`` is S: upper triangular R x R (``input_factor``), or a vector of R positive
    row weights (a diagonal S). The cores come back in the matrix's dtype."""
    check_matrix(matrix, spec)
    if spec.layout != "tt":
        raise ShapeError(expected("a tt-layout spec", spec.layout))
    if tuple(factor.shape) not in ((spec.rows, spec.rows), (spec.rows,)):
        raise ShapeError(expected(f"a {spec.rows} x {spec.rows} input factor (or {spec.rows} row weights)",
                                  tuple(factor.shape)))
    d = len(spec.row_modes)
    factor = _padded_factor(factor.to(torch.float64), spec.padded_rows)
    work = padded(matrix.detach().to(torch.float64, copy=True), spec)  # its own: scaled in place below
    whitened = work.mul_(factor[:, None]) if factor.dim() == 1 else factor @ work
    del work  # a 32000 x 2048 embedding is 0.5 GB in float64: one such copy at a time
    out_cores, middle = _right_sweep(whitened.reshape((spec.padded_rows,) + spec.col_modes), spec.ranks[d - 1:])
    # S^{-1} A: the input half.
    if factor.dim() == 1:
        left = middle / factor[:, None]
    else:
        left = torch.linalg.solve_triangular(factor, middle, upper=True)
    in_cores = _scaled_input_half(left, spec, _row_weights(factor))
    return pad_cores([c.to(matrix.dtype) for c in in_cores + out_cores], spec)


def _row_weights(factor: torch.Tensor) -> torch.Tensor:
    """Each input row's weight, sqrt(G_ii): the column norms of S (S^T S = G), or a diagonal S itself."""
    return factor.abs() if factor.dim() == 1 else factor.norm(dim=0)


def _scaled_input_half(left: torch.Tensor, spec: TTSpec, row_weights: torch.Tensor) -> list[torch.Tensor]:
    """Cores over the input modes of the input half (R x r, the middle bond last): TT-SVD of the
    half with its rows scaled by the per-mode product closest to ``row_weights``, each core's mode
    scaled back after, so the input-side truncations also favour the rows that carry input."""
    d, r_mid = len(spec.row_modes), left.shape[1]
    if d == 1:  # one input mode (--modes 1, a truncated SVD): the half is its only core, exactly
        return [left.reshape(1, spec.row_modes[0], r_mid)]
    vectors = mode_weights(row_weights[: spec.rows], spec.row_modes, spec.padded_rows)
    scale = _outer_product(vectors)
    in_modes = spec.row_modes[:-1] + (spec.row_modes[-1] * r_mid,)
    cores = tt_svd((left * scale[:, None]).reshape(in_modes), spec.ranks[: d - 1])
    last = cores[-1]
    cores[-1] = last.reshape(last.shape[0], spec.row_modes[-1], r_mid)
    return [core / v[None, :, None] for core, v in zip(cores, vectors)]


def _padded_factor(factor: torch.Tensor, rows: int) -> torch.Tensor:
    """S extended by the identity over padding rows (they hold zeros and carry no input); a 1-D
    factor is a diagonal one."""
    extra = rows - factor.shape[0]
    if not extra:
        return factor
    if factor.dim() == 1:
        return torch.cat([factor, factor.new_ones(extra)])
    grown = torch.eye(rows, dtype=factor.dtype, device=factor.device)
    grown[: factor.shape[0], : factor.shape[0]] = factor
    return grown


def mode_weights(row_weights: torch.Tensor, row_modes, padded_rows: int, sweeps: int = 10) -> list[torch.Tensor]:
    """Positive vectors w_k (one per input mode) whose outer product best fits the row weights
    (a rank-1 fit by alternating updates; padding rows get the smallest weight)."""
    weights = row_weights.to(torch.float64).clamp_min(0)
    floor = float(weights[weights > 0].min()) if bool((weights > 0).any()) else 1.0
    full = torch.full((padded_rows,), floor, dtype=torch.float64, device=weights.device)
    full[: weights.shape[0]] = weights.clamp_min(floor)
    tensor = full.reshape(row_modes)
    vectors = [torch.ones(m, dtype=torch.float64, device=weights.device) for m in row_modes]
    letters = "abcdefgh"[: len(row_modes)]
    for _ in range(sweeps):
        for k in range(len(row_modes)):
            others = [v for i, v in enumerate(vectors) if i != k]
            subscripts = ",".join(letters[i] for i in range(len(row_modes)) if i != k)
            projected = torch.einsum(f"{letters},{subscripts}->{letters[k]}", tensor, *others)
            norm = 1.0
            for v in others:
                norm *= float(v @ v)
            vectors[k] = (projected / norm).clamp_min(1e-12)
    return vectors


def _outer_product(vectors: list[torch.Tensor]) -> torch.Tensor:
    """w_1 (x) w_2 (x) ... flattened: one weight per row of the (padded) matrix."""
    scale = vectors[0]
    for v in vectors[1:]:
        scale = torch.outer(scale, v).reshape(-1)
    return scale


def scaled_ttm_cores(matrix: torch.Tensor, spec: TTSpec, row_weights: torch.Tensor) -> list[torch.Tensor]:
    """ttm-layout cores that weight the rows of M by ``row_weights`` (R, non-negative), through the
    closest product of per-mode weights: each core's input mode is scaled back after TTM-SVD."""
    check_matrix(matrix, spec)
    if spec.layout != "ttm":
        raise ShapeError(expected("a ttm-layout spec", spec.layout))
    if tuple(row_weights.shape) != (spec.rows,):
        raise ShapeError(expected(f"{spec.rows} row weights", tuple(row_weights.shape)))
    vectors = mode_weights(row_weights, spec.row_modes, spec.padded_rows)
    scale = _outer_product(vectors)
    work = padded(matrix.detach().to(torch.float64), spec) * scale[:, None]
    flat = tt_svd(interleave(work, spec), spec.ranks)
    cores = [c.reshape(c.shape[0], m, n, c.shape[2]) / v[None, :, None, None]
             for c, m, n, v in zip(flat, spec.row_modes, spec.col_modes, vectors)]
    return pad_cores([c.to(matrix.dtype) for c in cores], spec)


def whitened_ttm_cores(matrix: torch.Tensor, spec: TTSpec, gram: torch.Tensor) -> list[torch.Tensor]:
    """ttm-layout cores that lower ||S (M - M_tt)|| for the input Gram matrix G = S^T S (R x R):
    TTM-SVD with rows weighted by sqrt(G_ii), then ALS sweeps on the whole objective (``als``)."""
    check_matrix(matrix, spec)
    if tuple(gram.shape) != (spec.rows, spec.rows):
        raise ShapeError(expected(f"a {spec.rows} x {spec.rows} Gram matrix", tuple(gram.shape)))
    cores = scaled_ttm_cores(matrix, spec, gram.diagonal().clamp_min(0).sqrt())
    padded_gram = gram.new_zeros(spec.padded_rows, spec.padded_rows)  # padding rows carry no input
    padded_gram[: spec.rows, : spec.rows] = gram
    return als_refine(padded(matrix.detach(), spec), cores, spec, padded_gram)  # in its compute dtype


def whitened_pair(left: torch.Tensor, right: torch.Tensor, factor: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A low-rank pair ``left @ right`` (R x r, r x C) re-expressed as ``left' @ diag(sigma) @ right'``
    over the same rank, its directions ordered by how much they carry of the output on the inputs:
    with ``factor`` S (S^T S = G, the inputs' Gram), S left' has orthonormal columns, right' has
    orthonormal rows and ``sigma`` descends, so dropping the last k directions is the best rank
    r - k approximation of the pair on those inputs (SVD of S left right, through a QR of S left:
    no R x C matrix). Float64 inside; returned in ``left``'s dtype."""
    if factor.shape != (left.shape[0], left.shape[0]) or left.shape[1] != right.shape[0]:
        raise ShapeError(expected(f"a {left.shape[0]} x {left.shape[0]} factor and a pair sharing its rank",
                                  (tuple(factor.shape), tuple(left.shape), tuple(right.shape))))
    dtype = left.dtype
    factor, left, right = (t.detach().to(torch.float64) for t in (factor, left, right))
    q, small = torch.linalg.qr(factor @ left)
    u, sigma, vh = torch.linalg.svd(small @ right, full_matrices=False)
    ordered_left = torch.linalg.solve_triangular(factor, q @ u, upper=True)
    return ordered_left.to(dtype), sigma.to(dtype), vh.to(dtype)


def equal_norm_pair(left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same product ``left @ right`` with each direction's column of ``left`` and row of
    ``right`` of one Euclidean norm (the geometric mean of the two): factors stepped at one
    learning rate then move at one relative pace. A direction that is zero on either side is kept."""
    left_norms, right_norms = left.norm(dim=0), right.norm(dim=1)
    scale = (right_norms / left_norms).sqrt()
    scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
    return left * scale, right / scale[:, None]
