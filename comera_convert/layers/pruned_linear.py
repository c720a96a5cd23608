"""PrunedLinear: one side of a feed-forward pair whose hidden neurons were pruned.

A transformer's feed-forward block is ``down(act(up(x)))`` with an elementwise ``act``: its hidden
neurons can be removed as a whole (a row of ``up``, the matching column of ``down``) and the block
still computes the same kind of function, only narrower. Both sides are then plain linears, one
with fewer outputs (``pruned="out"``: up), one with fewer inputs (``pruned="in"``: down); this class
is nn.Linear plus the width it was pruned from, which the checkpoint records and ``expanded``
restores (the pruned neurons as zeros: ``act(0)`` is 0 for GELU, ReLU and SiLU, and a zero column
of ``down`` ignores them anyway), for ``comera decompress``.

With integer storage (``--dtype int8|int4``) its weight is stored as every dense matrix is (a scale
per row, or per group of a row's values); ``integer_format`` set, the forward pass runs on the
weight rounded so (``fake_quantize``), as a TT layer's on its cores, so that reconstruction and
training learn what the rounding keeps.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import expected
from ..integer import fake_quantize

SIDES = ("out", "in")


class PrunedLinear(nn.Linear):
    """nn.Linear with ``pruned`` ("out" or "in") features kept of ``dense_features``; ``integer_format``
    (None: float) the grid its forward pass rounds the weight to (module docstring)."""

    integer_format = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, pruned: str,
                 dense_features: int, device=None, dtype=None):
        if pruned not in SIDES:
            raise ValueError(expected(f"pruned in {SIDES}", pruned))
        kept = out_features if pruned == "out" else in_features
        if not 0 < kept <= dense_features:
            raise ValueError(expected(f"between 1 and {dense_features} kept {pruned} features", kept))
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.pruned, self.dense_features = pruned, dense_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.integer_format is None:
            return super().forward(x)
        return F.linear(x, fake_quantize(self.weight, self.integer_format, 0), self.bias)

    @property
    def kept(self) -> int:
        """The hidden neurons this side keeps."""
        return self.out_features if self.pruned == "out" else self.in_features

    @torch.no_grad()
    def expanded(self) -> nn.Linear:
        """The nn.Linear of the unpruned shape computing the same pair: the kept neurons first, the
        others zero (weights and, on the ``out`` side, biases)."""
        rows, cols = ((self.dense_features, self.in_features) if self.pruned == "out"
                      else (self.out_features, self.dense_features))
        dense = nn.Linear(cols, rows, bias=self.bias is not None, device=self.weight.device, dtype=self.weight.dtype)
        dense.weight.zero_()
        dense.weight[:self.out_features, :self.in_features] = self.weight
        if self.bias is not None:
            dense.bias.zero_()
            dense.bias[:self.out_features] = self.bias
        return dense

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.kept} of {self.dense_features} hidden neurons kept"
