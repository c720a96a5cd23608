"""TT-SVD and TTM-SVD: tensor-train cores from a dense matrix, and the dense matrix back.

TT-SVD (Oseledets, "Tensor-Train Decomposition", SIAM J. Sci. Comput. 2011, Alg. 1) sweeps
left to right: unfold what is left into (r_{k-1} s_k) x (rest), keep the top r_k singular
vectors as core k, carry S V^T on. The error obeys ||A - A_tt||_F^2 <= sum_k eps_k^2, with
eps_k the discarded singular values of the k-th unfolding.

This is the direct torch.linalg.svd implementation; tensorly's ``tensor_train`` and
``tensor_train_matrix`` (see ``reference.py``) are the reference it is tested against.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError, expected
from .contract import merge_left
from .spec import TTSpec


def decomposition_dtype(dtype: torch.dtype) -> torch.dtype:
    """Decompositions run in float64 for float64 input and in float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def left_singular_vectors(unfolding: torch.Tensor, rank: int) -> torch.Tensor:
    """The top ``rank`` left singular vectors of an m x n matrix A (m x rank, orthonormal).

    From the eigenvectors of the smaller Gram matrix rather than a full SVD: an m x m eigh costs
    a third of a 768 x 768 SVD and far less for wide unfoldings (30522 x 768 at ranks 30 drops
    from 13.8 s to 0.6 s). For tall A, the top right vectors V_r come from A^T A and the left
    ones are an orthonormal basis of A V_r (the same span, without dividing by small sigmas).
    A bond whose rank is the full rank of the unfolding needs no decomposition at all.
    """
    m, n = unfolding.shape
    rank = min(rank, m, n)
    if rank == m:
        # A bond at full rank truncates nothing: any orthonormal basis will do, and I is one.
        return torch.eye(m, dtype=unfolding.dtype, device=unfolding.device)
    if rank == n:
        basis, _ = torch.linalg.qr(unfolding)  # the column space itself
        return basis
    if m <= n:
        return top_eigenvectors(gram(unfolding), rank)
    basis, _ = torch.linalg.qr(unfolding @ top_eigenvectors(gram(unfolding.T), rank))
    return basis


def gram(matrix: torch.Tensor) -> torch.Tensor:
    """matrix @ matrix.T, of which only the lower triangle is to be read (what ``top_eigenvectors``
    reads). On the CPU BLAS's syrk computes just that triangle: half the products, 0.13 s against
    0.22 s for a 2048 x 5632 unfolding on 2 cores."""
    if matrix.device.type != "cpu" or matrix.dtype not in (torch.float32, torch.float64):
        return matrix @ matrix.T
    from scipy.linalg import blas

    # BLAS takes Fortran order: a C-contiguous matrix is passed as its transpose (a a^T = b^T b with
    # b = a^T), a transposed view as itself; either way without a copy.
    if matrix.is_contiguous():
        operand, trans = matrix.T.numpy(), 1
    elif matrix.T.is_contiguous():
        operand, trans = matrix.numpy(), 0
    else:
        return matrix @ matrix.T
    syrk = blas.get_blas_funcs("syrk", (operand,))
    return torch.from_numpy(syrk(1.0, operand, trans=trans, lower=1))


# Below this share of the eigenvectors, LAPACK's subset solver (bisection and inverse iteration,
# ?syevx) beats the full one (divide and conquer): on 2 cores, the top 333 of a 2048 x 2048 Gram
# matrix take 0.23 s against 0.42 s; past about half, the full solver wins.
SUBSET_SHARE = 0.5


def top_eigenvectors(symmetric: torch.Tensor, count: int) -> torch.Tensor:
    """The eigenvectors of the ``count`` largest eigenvalues of a symmetric matrix given by its
    lower triangle, largest first."""
    size = symmetric.shape[0]
    if symmetric.device.type == "cpu" and count < SUBSET_SHARE * size:
        from scipy.linalg import eigh

        _, vectors = eigh(symmetric.numpy(), lower=True, subset_by_index=[size - count, size - 1], driver="evx",
                          overwrite_a=True, check_finite=False)
        return torch.from_numpy(vectors).flip(-1)
    _, vectors = torch.linalg.eigh(symmetric, UPLO="L")  # ascending eigenvalues
    return vectors[:, -count:].flip(-1)


def tt_svd(tensor: torch.Tensor, ranks) -> list[torch.Tensor]:
    """Cores (r_{k-1}, s_k, r_k) of a tensor of shape (s_1, ..., s_K) with bond ranks <= ranks."""
    modes = tensor.shape
    if len(ranks) != len(modes) - 1:
        raise ShapeError(expected(f"{len(modes) - 1} ranks for a tensor of order {len(modes)}", ranks))
    cores = []
    rest = tensor
    r_prev = 1
    for k, s in enumerate(modes[:-1]):
        # Step k: unfold into (r_{k-1} s_k) x (remaining modes), keep its top r_k left singular
        # vectors as core k and carry the projection U^T A (= S V^T of the truncated SVD) on.
        unfolding = rest.reshape(r_prev * s, -1)
        u = left_singular_vectors(unfolding, int(ranks[k]))
        r = u.shape[1]
        cores.append(u.reshape(r_prev, s, r))
        # At full rank u is the identity: the projection would only copy (a 32000 x 2048 embedding's
        # first bond is full: 262 MB of float32 spared).
        rest = unfolding if r == unfolding.shape[0] else u.T @ unfolding
        r_prev = r
    cores.append(rest.reshape(r_prev, modes[-1], 1))
    return cores


def contract_chain(cores: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor (s_1, ..., s_K) of a chain of 3-way cores (r_{k-1}, s_k, r_k): the forward
    pass's ``merge_left`` over the whole chain (r_K = 1), reshaped to the modes."""
    return merge_left(cores).reshape([core.shape[1] for core in cores])


def check_matrix(matrix: torch.Tensor, spec: TTSpec) -> None:
    if matrix.dim() != 2 or tuple(matrix.shape) != (spec.rows, spec.cols):
        raise ShapeError(expected(f"a {spec.rows} x {spec.cols} matrix", tuple(matrix.shape)))


def padded(matrix: torch.Tensor, spec: TTSpec) -> torch.Tensor:
    """Zero-pad the matrix up to prod(row_modes) x prod(col_modes)."""
    pad_rows, pad_cols = spec.padded_rows - spec.rows, spec.padded_cols - spec.cols
    if pad_rows or pad_cols:
        matrix = torch.nn.functional.pad(matrix, (0, pad_cols, 0, pad_rows))
    return matrix


def interleave(matrix: torch.Tensor, spec: TTSpec) -> torch.Tensor:
    """(R, C) -> (m_1 n_1, ..., m_d n_d), the order TTM-SVD decomposes."""
    d = len(spec.row_modes)
    tensor = matrix.reshape(spec.row_modes + spec.col_modes)
    order = [i for k in range(d) for i in (k, d + k)]
    return tensor.permute(order).reshape(spec.bond_modes)


def _deinterleave(tensor: torch.Tensor, spec: TTSpec) -> torch.Tensor:
    """(m_1, n_1, ..., m_d, n_d) -> (R, C): the inverse of ``interleave``."""
    d = len(spec.row_modes)
    pairs = [m for pair in zip(spec.row_modes, spec.col_modes) for m in pair]
    order = [2 * k for k in range(d)] + [2 * k + 1 for k in range(d)]
    return tensor.reshape(pairs).permute(order).reshape(spec.padded_rows, spec.padded_cols)


def matrix_to_cores(matrix: torch.Tensor, spec: TTSpec) -> list[torch.Tensor]:
    """Decompose an R x C matrix into the cores of ``spec`` (TT-SVD or TTM-SVD by layout).

    Runs in float32 (float64 for float64 input) and returns cores in the input's dtype. Ranks
    come out as spec.ranks or smaller where the matrix has lower rank at a bond; callers that
    need exact shapes pad with ``pad_cores``.
    """
    check_matrix(matrix, spec)
    # One copy, contiguous (a transposed weight would otherwise be cast, then copied again to reshape).
    work = padded(matrix.detach().to(decomposition_dtype(matrix.dtype), memory_format=torch.contiguous_format), spec)
    if spec.layout == "tt":
        cores = tt_svd(work.reshape(spec.bond_modes), spec.ranks)
    else:
        flat = tt_svd(interleave(work, spec), spec.ranks)
        cores = [c.reshape(c.shape[0], m, n, c.shape[2])
                 for c, m, n in zip(flat, spec.row_modes, spec.col_modes)]
    return pad_cores([c.to(matrix.dtype) for c in cores], spec)


def pad_cores(cores: list[torch.Tensor], spec: TTSpec) -> list[torch.Tensor]:
    """Zero-pad cores whose bonds came out smaller than spec.ranks (a rank-deficient matrix)."""
    full = []
    for core, shape in zip(cores, spec.core_shapes()):
        if tuple(core.shape) != shape:
            grown = core.new_zeros(shape)
            grown[tuple(slice(0, s) for s in core.shape)] = core
            core = grown
        full.append(core.contiguous())
    return full


def cores_to_matrix(cores: list[torch.Tensor], spec: TTSpec) -> torch.Tensor:
    """The R x C matrix the cores of ``spec`` represent (padding sliced off)."""
    if spec.layout == "tt":
        full = contract_chain(cores).reshape(spec.padded_rows, spec.padded_cols)
    else:
        flat = [c.reshape(c.shape[0], c.shape[1] * c.shape[2], c.shape[3]) for c in cores]
        full = _deinterleave(contract_chain(flat), spec)
    return full[: spec.rows, : spec.cols]


def unfolding_tail_bound(matrix: torch.Tensor, spec: TTSpec) -> float:
    """The TT-SVD error bound sqrt(sum_k eps_k^2) for this matrix and spec.

    eps_k is the norm of the singular values the k-th unfolding of the (padded, for ttm
    interleaved) tensor loses when truncated to rank r_k.
    """
    work = padded(matrix.detach().to(torch.float64), spec)
    tensor = work.reshape(spec.bond_modes) if spec.layout == "tt" else interleave(work, spec)
    modes = spec.bond_modes
    total = 0.0
    for k, r in enumerate(spec.ranks):
        left = 1
        for s in modes[: k + 1]:
            left *= s
        sv = torch.linalg.svdvals(tensor.reshape(left, -1))
        total += float((sv[r:] ** 2).sum())
    return total ** 0.5
