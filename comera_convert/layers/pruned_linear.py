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

While it trains with rank adaptation, the ``in`` side may carry a gate on its hidden neurons
(``add_neuron_gate_``): a diagonal between the activation and ``down``, as CoMERA's gates sit on a TT
bond, so that the budget closes neurons the way it closes ranks (``training/neuron_gates.py``). The
export folds the gate into the weight and drops it (``fold_neuron_gate_``).
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
        self.gates: nn.ParameterList | None = None  # one gate over the hidden neurons (``in`` side, training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.integer_format is None and self.gates is None:
            return super().forward(x)
        return F.linear(x, self.gated_weight(), self.bias)

    def gated_weight(self) -> torch.Tensor:
        """The weight with the neuron gate folded into its columns (rounded to ``integer_format`` when set):
        what the forward pass multiplies by. A column is a neuron's weight, so gating the weight is gating
        the neuron, at the cost of one product the size of the weight rather than of the activations."""
        weight = self.weight if self.gates is None else self.weight * self.gates[0]
        return weight if self.integer_format is None else fake_quantize(weight, self.integer_format, 0)

    def add_neuron_gate_(self) -> None:
        """Give the ``in`` side a gate of ones over its hidden neurons (the pair computes what it did)."""
        if self.pruned != "in":
            raise ValueError(expected("the in side of a pruned pair (down) to carry the neuron gate", self.pruned))
        if self.gates is None:
            gate = torch.ones(self.in_features, device=self.weight.device, dtype=self.weight.dtype)
            self.gates = nn.ParameterList([nn.Parameter(gate)])

    @torch.no_grad()
    def fold_neuron_gate_(self) -> None:
        """Fold the gate into the weight's columns and drop it: a plain pruned layer computing the same."""
        if self.gates is not None:
            self.weight.mul_(self.gates[0])
            del self.gates
            self.gates = None

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
        gated = ", gated" if self.gates is not None else ""
        return f"{super().extra_repr()}, {self.kept} of {self.dense_features} hidden neurons kept{gated}"
