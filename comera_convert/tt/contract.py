"""Contractions of TT matrices with inputs: the forward passes of TT layers, as plain functions.

None of these materializes the dense matrix. The tt layout merges its row half into an R x r
matrix and its column half into an r x C matrix (cheap: they do not depend on the batch), then
runs two skinny GEMMs, x -> x L -> x L R, as CoMERA does. The ttm layout merges cores 1..h and
h+1..d into two half tensors A (R_1, C_1, r) and B (r, R_2, C_2) and contracts the input with
B, then A; embeddings gather rows from the same halves.
"""

from __future__ import annotations

import torch

from .spec import TTSpec


def apply_gates(cores: list[torch.Tensor], gates) -> list[torch.Tensor]:
    """Scale each core's right bond by its diagonal gate (CoMERA's rank controls)."""
    if gates is None:
        return list(cores)
    gated = [core * gate for core, gate in zip(cores, gates)]  # gate broadcasts over the last axis
    return gated + [cores[-1]]


def merge_left(cores: list[torch.Tensor]) -> torch.Tensor:
    """Contract 3-way cores G_1..G_k (r_0 = 1) into a (s_1 ... s_k) x r_k matrix."""
    result = cores[0].reshape(-1, cores[0].shape[-1])
    for core in cores[1:]:
        r, s, r_next = core.shape
        result = (result @ core.reshape(r, s * r_next)).reshape(-1, r_next)
    return result


def merge_right(cores: list[torch.Tensor]) -> torch.Tensor:
    """Contract 3-way cores G_k..G_K (r_K = 1) into an r_{k-1} x (s_k ... s_K) matrix."""
    result = cores[-1].reshape(cores[-1].shape[0], -1)
    for core in reversed(cores[:-1]):
        r_prev, s, r = core.shape
        result = (core.reshape(r_prev * s, r) @ result).reshape(r_prev, -1)
    return result


def tt_halves(cores: list[torch.Tensor], spec: TTSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The row half (R x r) and column half (r x C) of a tt-layout matrix, padding sliced off."""
    left = merge_left(cores[: spec.split])[: spec.rows]
    right = merge_right(cores[spec.split:])[:, : spec.cols]
    return left, right


class ThroughBond(torch.autograd.Function):
    """y = (x L) R for x (T x R), L (R x r), R (r x C): two skinny GEMMs, and a backward that saves
    only x, L, R and h = x L (as CoMERA does) and orients every GEMM the way CPU BLAS runs fast.

    The weight gradients are taken as (h^T g)^T-style products with the long token axis as the
    inner dimension of a row-major left operand: on 2 CPU cores x^T g (768 x 1024 x 30) takes
    3.4 ms, g^T x 0.37 ms, for the same numbers.
    """

    @staticmethod
    def forward(ctx, x, left, right, bias):
        h = x @ left
        ctx.save_for_backward(x, left, right, h)
        ctx.has_bias = bias is not None
        return h @ right if bias is None else torch.addmm(bias, h, right)  # bias fused into the GEMM

    @staticmethod
    def backward(ctx, grad_y):
        x, left, right, h = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_right = h.t() @ grad_y if ctx.needs_input_grad[2] else None
        grad_h = grad_y @ right.t()
        grad_x = grad_h @ left.t() if ctx.needs_input_grad[0] else None
        grad_left = (grad_h.t() @ x).t() if ctx.needs_input_grad[1] else None
        grad_bias = grad_y.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_x, grad_left, grad_right, grad_bias


def gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM on ``x`` runs in: autocast's where it is on (as F.linear would run), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def through_bond(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., R) -> x L R + b (..., C)."""
    flat = x.reshape(-1, x.shape[-1])
    # Every operand in one dtype before the Function: its backward runs outside autocast, where a
    # float32 x saved beside a bfloat16 gradient could not meet in one GEMM.
    dtype = gemm_dtype(flat)
    flat, left, right = flat.to(dtype), left.to(dtype), right.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if torch.is_grad_enabled():
        y = ThroughBond.apply(flat, left, right, bias)
    else:  # inference: the same two GEMMs without the autograd.Function's per-call overhead
        h = flat @ left
        y = h @ right if bias is None else torch.addmm(bias, h, right)
    return y.reshape(*x.shape[:-1], right.shape[-1])


def tt_linear(x: torch.Tensor, cores: list[torch.Tensor], spec: TTSpec,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., R) -> x M + b (..., C) for the tt layout: two skinny GEMMs through the rank-r bond."""
    left, right = tt_halves(cores, spec)
    return through_bond(x, left, right, bias)


def _merge_ttm_left(cores: list[torch.Tensor]) -> torch.Tensor:
    """4-way cores 1..h -> A of shape (R_1, C_1, r_h)."""
    first = cores[0]
    acc = first.reshape(first.shape[1], first.shape[2], first.shape[3])
    for core in cores[1:]:
        r, m, n, r_next = core.shape
        rows, cols = acc.shape[0], acc.shape[1]
        acc = (acc.reshape(rows * cols, r) @ core.reshape(r, m * n * r_next))
        acc = acc.reshape(rows, cols, m, n, r_next).permute(0, 2, 1, 3, 4)
        acc = acc.reshape(rows * m, cols * n, r_next)
    return acc


def _merge_ttm_right(cores: list[torch.Tensor]) -> torch.Tensor:
    """4-way cores h+1..d -> B of shape (r_h, R_2, C_2)."""
    last = cores[-1]
    acc = last.reshape(last.shape[0], last.shape[1], last.shape[2])
    for core in reversed(cores[:-1]):
        r_prev, m, n, r = core.shape
        rows, cols = acc.shape[1], acc.shape[2]
        acc = core.reshape(r_prev * m * n, r) @ acc.reshape(r, rows * cols)
        acc = acc.reshape(r_prev, m, n, rows, cols).permute(0, 1, 3, 2, 4)
        acc = acc.reshape(r_prev, m * rows, n * cols)
    return acc


def ttm_halves(cores: list[torch.Tensor], h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (R_1, C_1, r_h) from cores 1..h and B (r_h, R_2, C_2) from cores h+1..d."""
    return _merge_ttm_left(cores[:h]), _merge_ttm_right(cores[h:])


def ttm_linear(x: torch.Tensor, cores: list[torch.Tensor], spec: TTSpec, h: int) -> torch.Tensor:
    """x (..., R) -> x M (..., C) for the ttm layout, split after core h."""
    a, b = ttm_halves(cores, h)
    rows_l, cols_l, rank = a.shape
    _, rows_r, cols_r = b.shape
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if spec.padded_rows != spec.rows:
        x = torch.nn.functional.pad(x, (0, spec.padded_rows - spec.rows))
    tokens = x.shape[0]
    # t[t, a, r, c] = sum_b x[t, a, b] B[r, b, c]
    t = x.reshape(tokens * rows_l, rows_r) @ b.permute(1, 0, 2).reshape(rows_r, rank * cols_r)
    # y[t, e, c] = sum_{a, r} t[t, a, r, c] A[a, e, r]
    t = t.reshape(tokens, rows_l * rank, cols_r).transpose(1, 2)
    y = t @ a.permute(0, 2, 1).reshape(rows_l * rank, cols_l)
    y = y.transpose(1, 2).reshape(tokens, spec.padded_cols)[:, : spec.cols]
    return y.reshape(*lead, spec.cols)


def embedding_halves(cores: list[torch.Tensor], spec: TTSpec, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two half-products rows are gathered from: tt (R x r, r x C); ttm split after core h."""
    if spec.layout == "tt":
        return merge_left(cores[: spec.split]), merge_right(cores[spec.split:])[:, : spec.cols]
    return ttm_halves(cores, h)


def rows_from_halves(indices: torch.Tensor, halves, spec: TTSpec, deduplicate: bool = True) -> torch.Tensor:
    """Rows M[indices] (shape indices.shape + (C,)) from the half-products, without the full table.

    Each requested row is a product of a gathered slice of one half and one of the other. With
    ``deduplicate`` repeated indices share that work; without it the shapes do not depend on the
    data (no host sync), as CUDA graphs and torch.compile need.
    """
    flat = indices.reshape(-1)
    if deduplicate:
        unique, inverse = torch.unique(flat, return_inverse=True)
    else:
        unique, inverse = flat, None
    left, right = halves
    if spec.layout == "tt":
        rows = left.index_select(0, unique) @ right
    else:
        rows_r = right.shape[1]
        gathered_left = left.index_select(0, unique // rows_r)                  # (U, C_1, r)
        gathered_right = right.index_select(1, unique % rows_r).transpose(0, 1)  # (U, r, C_2)
        rows = (gathered_left @ gathered_right).reshape(unique.shape[0], -1)[:, : spec.cols]
    if inverse is not None:
        rows = rows.index_select(0, inverse)
    return rows.reshape(*indices.shape, spec.cols)


def embedding_rows(indices: torch.Tensor, cores: list[torch.Tensor], spec: TTSpec, h: int) -> torch.Tensor:
    """Rows M[indices] straight from the cores (both halves built for this call)."""
    return rows_from_halves(indices, embedding_halves(cores, spec, h), spec)
