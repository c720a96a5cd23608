"""Int8Linear: a linear layer for CPU inference whose GEMMs run in int8.

A TTLinear of the tt layout becomes two int8 GEMMs through its bond (x -> x L -> x L R + b); an
nn.Linear (or transformers' Conv1D) left dense becomes one. ``use_int8_compute`` swaps every such
layer of a model in place; the rest (embeddings, ttm-layout layers) stays as it was.
Inference only: the packed weights have no gradients, and a model so swapped is not saved (save
the checkpoint first; int8 compute is chosen when serving, not stored).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError, expected
from ..integer.compute import balance_bond, int8_engine, int8_linear, pack_int8
from ..tt.contract import tt_halves
from .swap import set_submodule
from .tt_linear import TTLinear, dense_weight_of, is_dense_linear


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W^T`` held as int8 GEMMs: one (a dense layer) or two (a low-rank pair
    ``L R``, balanced so that the bond's activations share one range)."""

    def __init__(self, in_features: int, out_features: int, packed: list, kind: str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed = packed  # torch's packed int8 weights, applied in order
        self.kind = kind

    @classmethod
    def from_tt(cls, layer: TTLinear) -> "Int8Linear":
        """Two int8 GEMMs through the bond of a tt-layout TTLinear (gates folded in)."""
        if layer.spec.layout != "tt":
            raise ConfigError(expected("a TTLinear of the tt layout (two GEMMs through its bond)", layer.spec.layout))
        with torch.no_grad():
            left, right = balance_bond(*tt_halves(layer.gated_cores(), layer.spec))
            packed = [pack_int8(left.t()), pack_int8(right.t(), layer.bias)]
        return cls(layer.in_features, layer.out_features, packed, f"rank {left.shape[1]}")

    @classmethod
    def from_linear(cls, linear: nn.Module) -> "Int8Linear":
        """One int8 GEMM for an nn.Linear or Conv1D."""
        weight, bias = dense_weight_of(linear)
        with torch.no_grad():
            packed = [pack_int8(weight, bias)]
        return cls(weight.shape[1], weight.shape[0], packed, "dense")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 GEMMs in turn, float32 in and out."""
        if x.shape[-1] != self.in_features:
            raise ValueError(expected(f"input with last dimension {self.in_features}", tuple(x.shape)))
        if x.dtype != torch.float32:
            raise ConfigError(expected("float32 input to an int8-compute layer (it rounds its input itself)", x.dtype))
        if x.requires_grad:
            raise ConfigError("int8 compute is for inference: its packed weights have no gradients "
                              "(train the float model, then swap)")
        y = x.reshape(-1, self.in_features)
        for packed in self.packed:
            y = int8_linear(y, packed)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The packed weights are no tensors a state dict holds: saving would write a model without
        # these layers' weights, which would load silently wrong.
        raise ConfigError(f"{prefix.rstrip('.') or 'the model'} computes in int8 and is not saved: save the "
                          "float model, and call use_int8_compute when serving")

    def extra_repr(self) -> str:
        """Shapes and the GEMMs the layer runs, for ``print(model)``."""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 GEMMs ({self.kind})"


@dataclass
class Int8Swap:
    """What ``use_int8_compute`` changed: layers by kind, and those it left in float with the reason."""

    low_rank: int = 0
    dense: int = 0
    kept_float: dict[str, str] = field(default_factory=dict)


def use_int8_compute(model: nn.Module, dense_layers: bool = True) -> Int8Swap:
    """Swap the model's tt-layout TTLinears (and, with ``dense_layers``, its dense linears) for
    ``Int8Linear`` in place, for inference on a CPU in float32."""
    int8_engine()  # fails first, with one line, on a torch build without the kernels
    parameter = next(model.parameters(), None)
    if parameter is not None and parameter.device.type != "cpu":
        raise ConfigError(expected("a model on the CPU (int8 compute runs torch's CPU kernels)", parameter.device))
    if parameter is not None and parameter.dtype != torch.float32:
        raise ConfigError(expected("a float32 model (int8 compute takes float32 in and out)", parameter.dtype))
    swap = Int8Swap()
    for name, module in list(model.named_modules()):
        if isinstance(module, TTLinear):
            if module.spec.layout != "tt":
                swap.kept_float[name] = f"{module.spec.layout} layout"
                continue
            set_submodule(model, name, Int8Linear.from_tt(module))
            swap.low_rank += 1
        elif dense_layers and is_dense_linear(module):
            set_submodule(model, name, Int8Linear.from_linear(module))
            swap.dense += 1
    return swap
