"""tensorly's TT-SVD and TTM-SVD behind the same signature as ``decompose.matrix_to_cores``.

The reference the direct implementation is tested against (and measured against: see
``examples/bench_tt_svd.py``). tensorly's backend is switched to PyTorch only inside a
context, so a user's global tensorly backend is left as it was.
"""

from __future__ import annotations

import tensorly as tl
import torch
from tensorly.decomposition import tensor_train, tensor_train_matrix

from .decompose import check_matrix, padded, decomposition_dtype, pad_cores
from .spec import TTSpec


def tensorly_matrix_to_cores(matrix: torch.Tensor, spec: TTSpec) -> list[torch.Tensor]:
    """Cores of ``spec`` for an R x C matrix, computed by tensorly (PyTorch backend)."""
    check_matrix(matrix, spec)
    work = padded(matrix.detach().to(decomposition_dtype(matrix.dtype)), spec)
    rank = list(spec.full_ranks)
    with tl.backend_context("pytorch"):
        if spec.layout == "tt":
            cores = list(tensor_train(work.reshape(spec.bond_modes), rank=rank).factors)
        else:
            tensor = work.reshape(spec.row_modes + spec.col_modes)
            cores = list(tensor_train_matrix(tensor, rank=rank).factors)
    return pad_cores([c.to(matrix.dtype) for c in cores], spec)
