"""Shape planning: factor a matrix dimension into d tensor modes.

A TT layer reshapes a dimension N into modes n_1 x ... x n_d. Balanced modes keep the cores
small; sizes that factor badly (30522 = 2 * 3 * 5087, 50257 = 29 * 1733) are padded up to the
nearest size that factors well and sliced back after the contraction, as CoMERA pads its
30522-row embedding to 32000.
"""

from __future__ import annotations

import math
from functools import lru_cache

from ..errors import ShapeError, expected

# A factorization is "balanced" when its largest mode is at most this many times its smallest:
# 768 = 12 x 8 x 8 (1.5) and 1536 = 16 x 12 x 8 (2.0) pass, 11008 = 43 x 16 x 16 (2.7) does not.
MAX_IMBALANCE = 2.0
# How far a size may be padded to reach a balanced factorization; the first balanced size wins,
# so real padding stays far below this (30522 -> 30600 is 0.26 %, 11008 -> 11016 is 0.07 %).
MAX_PADDING = 0.25
SUPPORTED_ORDERS = (1, 2, 3, 4, 5, 6)


def _factorizations(n: int, d: int, smallest: int = 2):
    """Yield every non-decreasing tuple of d factors >= smallest whose product is n."""
    if d == 1:
        if n >= smallest:
            yield (n,)
        return
    f = smallest
    while f ** d <= n:
        if n % f == 0:
            for rest in _factorizations(n // f, d - 1, f):
                yield (f,) + rest
        f += 1


@lru_cache(maxsize=4096)
def most_balanced(n: int, d: int) -> tuple[int, ...] | None:
    """The factorization of n into d modes >= 2 with the smallest max/min, or None."""
    if d == 1:
        return (n,)
    best = None
    for factors in _factorizations(n, d):
        key = (factors[-1] / factors[0], sum(factors))
        if best is None or key < best[0]:
            best = (key, factors)
    return None if best is None else best[1]


@lru_cache(maxsize=1024)
def plan_modes(n: int, d: int = 3) -> tuple[int, ...]:
    """Modes (sorted largest first) for a dimension n: product >= n, as balanced as possible.

    Searches sizes n, n + 1, ... for the first one with a factorization of max/min at most
    MAX_IMBALANCE; if none exists within MAX_PADDING, takes the most balanced one found.
    """
    if not isinstance(n, int) or n < 1:
        raise ShapeError(expected("a positive integer dimension", n))
    if d not in SUPPORTED_ORDERS:
        raise ShapeError(expected(f"a number of modes d in {SUPPORTED_ORDERS}", d))
    if d == 1:
        return (n,)
    if n < 2 ** d:
        raise ShapeError(f"dimension {n} is too small to split into {d} modes (needs at least {2 ** d})")
    fallback = None
    for size in range(n, math.ceil(n * (1 + MAX_PADDING)) + 1):
        modes = most_balanced(size, d)
        if modes is None:
            continue
        imbalance = modes[-1] / modes[0]
        if imbalance <= MAX_IMBALANCE:
            return tuple(sorted(modes, reverse=True))
        if fallback is None or imbalance < fallback[0]:
            fallback = (imbalance, modes)
    return tuple(sorted(fallback[1], reverse=True))


def check_modes(modes, n: int, name: str) -> tuple[int, ...]:
    """Validate user-given modes for a dimension of size n: positive ints, product >= n."""
    try:
        modes = tuple(int(m) for m in modes)
    except TypeError:
        raise ShapeError(expected(f"{name} as a sequence of integers", modes)) from None
    if not modes or any(m < 1 for m in modes):
        raise ShapeError(expected(f"{name} of positive integers", modes))
    if math.prod(modes) < n:
        raise ShapeError(f"{name} {modes} multiply to {math.prod(modes)}, expected at least {n}")
    return modes
