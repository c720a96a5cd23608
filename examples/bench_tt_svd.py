"""Time the direct TT-SVD against tensorly's on bert-base-sized weights.

    python examples/bench_tt_svd.py

Prints the median of a few runs per shape and layout; both produce the same cores.
"""

import statistics
import time

import torch

from comera_convert.tt import TTSpec, matrix_to_cores
from comera_convert.tt.reference import tensorly_matrix_to_cores

SHAPES = [(768, 768), (768, 3072), (3072, 768), (30522, 768)]


def median_seconds(fn, repeats=5):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    print(f"{'shape':>14} {'layout':>6} {'direct ms':>10} {'tensorly ms':>12} {'speedup':>8}")
    for rows, cols in SHAPES:
        matrix = torch.randn(rows, cols)
        for layout in ("tt", "ttm"):
            spec = TTSpec.plan(rows, cols, 30, layout=layout)
            ours = median_seconds(lambda: matrix_to_cores(matrix, spec))
            ref = median_seconds(lambda: tensorly_matrix_to_cores(matrix, spec))
            print(f"{rows:>6}x{cols:<7} {layout:>6} {ours * 1e3:>10.1f} {ref * 1e3:>12.1f} {ref / ours:>7.2f}x")


if __name__ == "__main__":
    main()
