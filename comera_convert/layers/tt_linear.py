"""TTLinear: a drop-in for nn.Linear whose weight is a tensor train."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import expected
from ..tt import matrix_to_cores, ttm_linear
from ..tt.contract import through_bond, tt_halves
from ..tt.counting import ttm_split
from ..tt.spec import TTSpec
from .base import TTModule, check_size

# CoMERA's linear configuration: 3 input and 3 output modes, internal ranks 30.
DEFAULT_ORDER = 3
DEFAULT_RANK = 30


def is_dense_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an nn.Linear or transformers' Conv1D (GPT-2's transposed linear)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def dense_weight_of(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight as out x in, bias) of an nn.Linear or of transformers' Conv1D (a transposed linear)."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if is_dense_linear(module):
        return module.weight.t(), module.bias
    raise TypeError(expected("an nn.Linear or transformers Conv1D", type(module).__name__))


class TTLinear(TTModule):
    """y = x W^T + b with W^T (in x out) held as TT cores.

    layout "tt": cores over the in modes then the out modes (CoMERA); forward merges each half
    and runs two skinny GEMMs, never building W. layout "ttm": one core per (in, out) mode pair.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 rank=DEFAULT_RANK, layout: str = "tt", d: int = DEFAULT_ORDER,
                 in_modes=None, out_modes=None, gates: bool = True, device=None, dtype=None):
        super().__init__()
        check_size("in_features", in_features)
        check_size("out_features", out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.dense_class = "Linear"
        spec = TTSpec.plan(in_features, out_features, rank, layout=layout, d=d,
                           row_modes=in_modes, col_modes=out_modes)
        self._init_factors(spec, gates, device=device, dtype=dtype)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random cores, scaled so that the product has the variance of the dense layer's initialization."""
        # The variance nn.Linear's default (Kaiming uniform, a = sqrt(5)) gives: 1 / (3 fan_in).
        self._random_init(target_std=math.sqrt(1.0 / (3 * self.in_features)))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Module, rank=DEFAULT_RANK, layout: str = "tt",
                    in_modes=None, out_modes=None, d: int = DEFAULT_ORDER, gates: bool = True,
                    decompose=matrix_to_cores) -> "TTLinear":
        """A TTLinear initialized from a dense layer by TT-SVD, on its device and in its dtype.

        ``decompose(matrix, spec)`` computes the cores; the default is the direct TT-SVD.
        """
        weight, bias = dense_weight_of(linear)
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias=bias is not None, rank=rank, layout=layout, d=d,
                    in_modes=in_modes, out_modes=out_modes, gates=gates,
                    device=weight.device, dtype=weight.dtype)
        layer.dense_class = type(linear).__name__  # "Linear", or "Conv1D" to decompress back to
        layer._load_cores(decompose(weight.detach().t(), layer.spec))
        if bias is not None:
            with torch.no_grad():
                layer.bias.copy_(bias)
        return layer

    def dense_weight(self) -> torch.Tensor:
        """The (out_features, in_features) weight the layer represents, like nn.Linear.weight."""
        return self.dense_matrix().t()

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, built on demand, for code that reads ``linear.weight`` (a copy: writing
        to it changes nothing)."""
        return self.dense_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` through the cores, without building ``W``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(expected(f"input with last dimension {self.in_features}", tuple(x.shape)))
        spec = self.spec
        if spec.layout == "tt":
            left, right = self.cached("halves", lambda: tt_halves(self.gated_cores(), spec))
            return through_bond(x, left, right, self.bias)
        tokens = x.numel() // self.in_features
        y = ttm_linear(x, self.gated_cores(), spec, ttm_split(spec, tokens))
        return y + self.bias.to(y.dtype) if self.bias is not None else y  # autocast's dtype, as F.linear

    def extra_repr(self) -> str:
        """Shapes, layout and ranks, for ``print(model)``."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self._tt_repr()}")
