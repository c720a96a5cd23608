"""Time the direct TT-SVD against tensorly's on bert-base-sized weights.

    python examples/bench_tt_svd.py

Prints the median of a few runs per shape and layout; both produce the same cores.
"""

import torch

from comera_convert.bench.timing import median_seconds
from comera_convert.tt import TTSpec, matrix_to_cores
from comera_convert.tt.reference import tensorly_matrix_to_cores

SHAPES = [(768, 768), (768, 3072), (3072, 768), (30522, 768)]


def main():
    print(f"{'shape':>14} {'layout':>6} {'direct ms':>10} {'tensorly ms':>12} {'speedup':>8}")
    for rows, cols in SHAPES:
        matrix = torch.randn(rows, cols)
        for layout in ("tt", "ttm"):
            spec = TTSpec.plan(rows, cols, 30, layout=layout)
            ours = median_seconds(lambda: matrix_to_cores(matrix, spec), repeats=5, warmup=1)
            ref = median_seconds(lambda: tensorly_matrix_to_cores(matrix, spec), repeats=5, warmup=1)
            print(f"{rows:>6}x{cols:<7} {layout:>6} {ours * 1e3:>10.1f} {ref * 1e3:>12.1f} {ref / ours:>7.2f}x")


if __name__ == "__main__":
    main()
