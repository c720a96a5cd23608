"""Pure tensor-train math over torch tensors: no nn.Module, no transformers.

shapes     factor a dimension into balanced modes (padding sizes that factor badly)
spec       TTSpec: layout, modes and ranks of a TT matrix, validated
decompose  TT-SVD / TTM-SVD from a dense matrix, and the dense matrix back
weighted   data-aware decompositions (the error on real inputs)
als        alternating least squares on ttm cores for an input Gram matrix
reference  the same decompositions by tensorly (the reference in tests)
contract   forward contractions: linear (tt, ttm) and embedding row lookups
counting   parameter and FLOP counts
"""

from .contract import apply_gates, embedding_rows, tt_halves, tt_linear, ttm_linear
from .counting import dense_params, linear_forward_flops, num_params
from .decompose import cores_to_matrix, matrix_to_cores, tt_svd
from .shapes import plan_modes
from .spec import LAYOUTS, TTSpec, clip_ranks

__all__ = [
    "LAYOUTS", "TTSpec", "apply_gates", "clip_ranks", "cores_to_matrix", "dense_params",
    "embedding_rows", "linear_forward_flops", "matrix_to_cores", "num_params", "plan_modes",
    "tt_halves", "tt_linear", "tt_svd", "ttm_linear",
]
