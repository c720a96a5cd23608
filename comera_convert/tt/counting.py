"""Parameter and FLOP counts of TT matrices, for rank allocation, reports and path choice.

FLOPs count a multiply-add as 2. "tokens" is the number of rows of the input (batch x seq).
"""

from __future__ import annotations

import math

from .spec import TTSpec


def num_params(spec: TTSpec) -> int:
    """Entries in all cores of ``spec`` (gates and bias not included)."""
    return sum(math.prod(shape) for shape in spec.core_shapes())


def num_gate_params(spec: TTSpec) -> int:
    """Entries in the diagonal rank gates: one per internal bond index."""
    return sum(spec.ranks)


def dense_params(spec: TTSpec) -> int:
    """Entries of the dense R x C matrix the spec stands for."""
    return spec.rows * spec.cols


def chain_merge_flops(modes, ranks_full) -> int:
    """FLOPs of contracting a chain of 3-way cores left to right into one (prod s) x r matrix."""
    flops, rows = 0, modes[0]
    for k in range(1, len(modes)):
        flops += 2 * rows * ranks_full[k] * modes[k] * ranks_full[k + 1]
        rows *= modes[k]
    return flops


def half_merge_flops(spec: TTSpec) -> int:
    """FLOPs of merging a tt-layout spec into its row half (R x r) and column half (r x C)."""
    r = spec.full_ranks
    split = spec.split
    left = chain_merge_flops(spec.row_modes, r[: split + 1])
    # The column half merges right to left: the same count over the reversed chain.
    right = chain_merge_flops(spec.col_modes[::-1], r[split:][::-1])
    return left + right


def linear_forward_flops(spec: TTSpec, tokens: int) -> int:
    """FLOPs of y = x M for ``tokens`` input rows, on the path the layer takes.

    tt: merge the two halves once, then x (T x R) -> (T x r) -> (T x C): two skinny GEMMs.
    ttm: merge the halves at the best split (see ``ttm_split``) and contract with the input.
    """
    if spec.layout == "tt":
        rank = spec.full_ranks[spec.split]
        return half_merge_flops(spec) + 2 * tokens * rank * (spec.padded_rows + spec.padded_cols)
    return ttm_linear_flops(spec, tokens, ttm_split(spec, tokens))


def ttm_half_sizes(spec: TTSpec, h: int) -> tuple[int, int, int, int, int]:
    """(rows_left, cols_left, rank, rows_right, cols_right) of a ttm spec split after core h."""
    return (math.prod(spec.row_modes[:h]), math.prod(spec.col_modes[:h]), spec.full_ranks[h],
            math.prod(spec.row_modes[h:]), math.prod(spec.col_modes[h:]))


def ttm_merge_flops(spec: TTSpec, h: int) -> int:
    """FLOPs of merging a ttm spec's cores 1..h and h+1..d into two half tensors."""
    r = spec.full_ranks
    flops, size = 0, spec.row_modes[0] * spec.col_modes[0]
    for k in range(1, h):
        flops += 2 * size * r[k] * spec.row_modes[k] * spec.col_modes[k] * r[k + 1]
        size *= spec.row_modes[k] * spec.col_modes[k]
    d = len(spec.row_modes)
    size = spec.row_modes[-1] * spec.col_modes[-1]
    for k in range(d - 2, h - 1, -1):
        flops += 2 * size * r[k + 1] * spec.row_modes[k] * spec.col_modes[k] * r[k]
        size *= spec.row_modes[k] * spec.col_modes[k]
    return flops


def ttm_linear_flops(spec: TTSpec, tokens: int, h: int) -> int:
    """FLOPs of x M for a ttm spec split after core h: merge, then contract the right half
    (rows_right -> rank x cols_right), then the left half (rows_left x rank -> cols_left)."""
    rl, cl, r, rr, cr = ttm_half_sizes(spec, h)
    return ttm_merge_flops(spec, h) + 2 * tokens * rl * rr * r * cr + 2 * tokens * rl * r * cr * cl


def ttm_split(spec: TTSpec, tokens: int, cost=None) -> int:
    """The split point h (1 <= h < d) with the fewest FLOPs for ``tokens`` rows.

    ``cost(spec, tokens, h)`` defaults to the linear layer's count; embeddings pass theirs.
    """
    cost = cost or ttm_linear_flops
    if len(spec.row_modes) < 2:
        raise ValueError(f"the ttm layout needs at least 2 cores to split (got {len(spec.row_modes)})")
    return min(range(1, len(spec.row_modes)), key=lambda h: cost(spec, tokens, h))


def embedding_lookup_flops(spec: TTSpec, tokens: int, h: int) -> int:
    """FLOPs of looking up ``tokens`` rows: merge the halves, then one small GEMM per token."""
    if spec.layout == "tt":
        rank = spec.full_ranks[spec.split]
        return half_merge_flops(spec) + 2 * tokens * rank * spec.padded_cols
    rl, cl, r, rr, cr = ttm_half_sizes(spec, h)
    return ttm_merge_flops(spec, h) + 2 * tokens * cl * r * cr


def dense_linear_flops(rows: int, cols: int, tokens: int) -> int:
    return 2 * tokens * rows * cols
