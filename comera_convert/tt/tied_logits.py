"""Logits through a ttm table, x E^T + b, built slab by slab and never whole.

A language-model head tied to a ttm embedding needs every row of the (vocab x dim) table E. The
table is a product of two halves, A (m_1, n_1, r) from the first core and B (r, R_2, C_2) from the
rest: the rows whose leading mode index is a form a slab E_a (R_2 x dim) = A[a] x B, one small
GEMM. ``TiedLogits`` runs the head one group of slabs at a time, forward and backward (where it
rebuilds them, or reuses them when they are no larger than the logits), and the table's gradient
goes group by group into the halves' gradients: neither the table nor its gradient is ever held
whole. That matters on a CPU, where each fresh 94 MB buffer (bert-base's table) costs a pass of
page faults and where the table and its gradients were most of a batch-1 training step's peak
memory. ``slab_rows`` bounds the rows built at once; a bound of at least the vocabulary gives the
one-table path (GPUs, whose caching allocator makes big buffers cheap).
"""

from __future__ import annotations

import torch

from .contract import gemm_dtype, ttm_halves
from .spec import TTSpec

# Rows built per slab group on CPU: 2048 x 768 floats is 6 MB. On 2 cores the head's forward and
# backward at bert-base shapes ran as fast with 2048 as with 8192 rows (within noise), and the
# whole table at once was slower.
CPU_SLAB_ROWS = 2048


def _slabs(a: torch.Tensor, b: torch.Tensor, rows: int, slab_rows: int):
    """(first TT row, slab group's row count, leading indices slice) for each group of slabs."""
    per_slab = b.shape[1]
    group = max(1, slab_rows // per_slab)
    for first in range(0, a.shape[0], group):
        start = first * per_slab
        if start >= rows:
            break
        stop = min(a.shape[0], first + group)
        yield start, min(stop * per_slab, rows) - start, slice(first, stop)


def _build(a_part: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The slabs of the leading indices in ``a_part`` in P order: (k, n_1, R_2, C_2)."""
    k, n1, r = a_part.shape
    _, r2, c2 = b.shape
    return (a_part.reshape(k * n1, r) @ b.reshape(r, r2 * c2)).reshape(k, n1, r2, c2)


def _as_rows(p: torch.Tensor, count: int, cols: int) -> torch.Tensor:
    """P order (k, n_1, R_2, C_2) -> table rows (count x cols), padding sliced off."""
    k, n1, r2, c2 = p.shape
    return p.permute(0, 2, 1, 3).reshape(k * r2, n1 * c2)[:count, :cols]


class TiedLogits(torch.autograd.Function):
    """logits (T x vocab) = x (T x cols) E^T + bias for E given by halves a, b; with ``row_of_token``
    the first ``vocab`` TT rows hold the tokens in another order (computed, then gathered by id)."""

    @staticmethod
    def forward(ctx, x, a, b, bias, row_of_token, rows: int, slab_rows: int):
        # The inputs arrive in one dtype (``tied_logits`` casts them); autocast would recast some
        # operands of the GEMMs that write into ``out=`` buffers and not others.
        with torch.autocast(x.device.type, enabled=False):
            return TiedLogits._forward(ctx, x, a, b, bias, row_of_token, rows, slab_rows)

    @staticmethod
    def _forward(ctx, x, a, b, bias, row_of_token, rows: int, slab_rows: int):
        fuse_bias = bias is not None and row_of_token is None
        logits = x.new_empty(x.shape[0], rows)
        # With at least as many tokens as columns the slabs together (the table) are no larger than
        # the logits, and backward reuses them; with fewer, backward rebuilds them instead.
        keep = x.shape[0] >= x.shape[1]
        kept = []
        for start, count, lead in _slabs(a, b, rows, slab_rows):
            slab = _as_rows(_build(a[lead], b), count, x.shape[1])
            if keep:
                kept.append(slab)
            out = logits[:, start:start + count]
            if fuse_bias:
                torch.addmm(bias[start:start + count], x, slab.t(), out=out)
            else:
                torch.mm(x, slab.t(), out=out)
        if row_of_token is not None:
            logits = logits.index_select(1, row_of_token)
            if bias is not None:
                logits.add_(bias)
        ctx.save_for_backward(x, a, b, row_of_token, *kept)
        ctx.slab_rows, ctx.rows, ctx.has_bias = slab_rows, rows, bias is not None
        return logits

    @staticmethod
    def backward(ctx, grad):
        x, a, b, row_of_token, *kept = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            return TiedLogits._backward(ctx, grad.to(x.dtype), x, a, b, row_of_token, kept)

    @staticmethod
    def _backward(ctx, grad, x, a, b, row_of_token, kept):
        grad = grad.contiguous()
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        if row_of_token is not None:  # back to TT-row order
            grad = torch.empty_like(grad).index_copy_(1, row_of_token.long(), grad)
        n1, r = a.shape[1:]
        _, r2, c2 = b.shape
        cols = x.shape[1]
        grad_x = torch.zeros_like(x)
        grad_a = torch.zeros_like(a)
        grad_b = torch.zeros(r, r2 * c2, dtype=b.dtype, device=b.device)
        for i, (start, count, lead) in enumerate(_slabs(a, b, ctx.rows, ctx.slab_rows)):
            a_part = a[lead]
            k = a_part.shape[0]
            grad_part = grad[:, start:start + count]
            slab = kept[i] if kept else _as_rows(_build(a_part, b), count, cols)
            grad_x.addmm_(grad_part, slab)
            # The slabs' gradient g^T x, padded back to whole slabs, in P order for the two halves
            # (zeroed first only where padding rows or columns stay unwritten).
            padded = count < k * r2 or cols < n1 * c2
            grad_rows = x.new_zeros(k * r2, n1 * c2) if padded else x.new_empty(k * r2, n1 * c2)
            torch.mm(grad_part.t(), x, out=grad_rows[:count, :cols])
            grad_p = grad_rows.view(k, r2, n1, c2).permute(0, 2, 1, 3).reshape(k * n1, r2 * c2)
            grad_a[lead] = (grad_p @ b.reshape(r, r2 * c2).t()).reshape(k, n1, r)
            grad_b.addmm_(a_part.reshape(k * n1, r).t(), grad_p)
        return grad_x, grad_a, grad_b.reshape(r, r2, c2), grad_bias, None, None, None


def tied_logits(x: torch.Tensor, cores: list[torch.Tensor], spec: TTSpec, bias: torch.Tensor | None = None,
                row_of_token: torch.Tensor | None = None, slab_rows: int | None = None) -> torch.Tensor:
    """x (..., cols) -> x E^T + b (..., vocab) for the ttm table E of ``cores``, in token-id order.

    row_of_token: the TT row of each token id (a reordered embedding), or None for rows in id order.
    slab_rows: rows built at once (default: CPU_SLAB_ROWS on CPU, the whole table elsewhere).
    """
    if spec.layout != "ttm":
        raise ValueError(f"expected a ttm-layout spec, got {spec.layout!r}")
    if slab_rows is None:
        slab_rows = CPU_SLAB_ROWS if x.device.type == "cpu" else spec.padded_rows
    a, b = ttm_halves(cores, 1)
    flat = x.reshape(-1, x.shape[-1])
    dtype = gemm_dtype(flat)  # one dtype for every operand, as through_bond
    flat, a, b = flat.to(dtype).contiguous(), a.to(dtype), b.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    logits = TiedLogits.apply(flat, a, b, bias, row_of_token, spec.rows, slab_rows)
    return logits.reshape(*x.shape[:-1], logits.shape[-1])
