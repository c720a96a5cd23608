"""Serving forms: a compressed model as plain torch modules, for a runtime's converter to trace and quantize.

A graph converter (OpenVINO's PyTorch frontend, torch's ONNX exporter) and the int8 quantizers after it
(NNCF, onnxruntime) see a linear layer as a product with a constant weight. The compressed layers compute
theirs from cores and gates, and look tokens up through range checks the tracer cannot follow; here each
becomes what it computes at inference, with the same outputs:

- a low-rank pair (a tt-layout ``TTLinear``) in one of two ``FORMS``: ``"pair"``, two ``nn.Linear`` through
  the bond (x -> x L -> x L R + b, the left factor's columns of unit norm so that the bond's activations
  share one range, as per-tensor int8 rounding of them needs), or ``"merged"``, the product ``L R`` as one
  ``nn.Linear``: more multiply-adds, one GEMM instead of two, which can run faster where the rank is near
  half the width, or in int8, where each GEMM pays for quantizing its input;
- a ``PrunedLinear`` (one side of a feed-forward pair pruned by neuron) as the narrow ``nn.Linear`` it is;
- a ``CodebookEmbedding`` as two gathers (each token's codes, then each code's centre);
- a ``TTEmbedding`` of the tt layout as a gather from its row half times its column half (the table is
  never built).

Layers of the ttm layout stay as they are: the tracer follows their core contractions, which hold a
fraction of the dense weights (multiplied out, a graph would store the dense model again).

Which form each pair takes is the caller's choice (``hf/form_timing.py`` times them on the machine).
Integer storage is honoured: the layers' rounded weights are what the forms hold.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from ..choices import SERVING_FORMS
from ..errors import expected
from ..integer.compute import balance_bond
from ..tt.contract import embedding_halves, tt_halves
from .codebook_embedding import CodebookEmbedding
from .pruned_linear import PrunedLinear
from .swap import set_submodule
from .tt_embedding import TTEmbedding
from .tt_linear import TTLinear

FORMS = SERVING_FORMS


class FactorPair(nn.Module):
    """``second(first(x))``: a low-rank pair as two linears through its bond."""

    def __init__(self, first: nn.Linear, second: nn.Linear):
        super().__init__()
        self.first, self.second = first, second

    @property
    def rank(self) -> int:
        return self.first.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class CodebookLookup(nn.Module):
    """Rows of a product-quantized table: each token's code per slice, then that code's centre in the
    slice's codebook, the slices side by side."""

    def __init__(self, layer: CodebookEmbedding):
        super().__init__()
        centres = layer.centres().detach()
        subspaces, codewords, width = centres.shape
        self.register_buffer("centres", centres.reshape(subspaces * codewords, width).clone())
        self.register_buffer("codes", layer.codes.clone())  # one byte a code, as the checkpoint stores them
        # code c of slice s is row s * codewords + c of the stacked codebooks
        self.register_buffer("offsets", torch.arange(subspaces, device=centres.device) * codewords)
        self.embedding_dim = layer.embedding_dim

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(F.embedding(indices, self.codes).long() + self.offsets, self.centres)
        return rows.reshape(*indices.shape, self.embedding_dim)


class HalvesLookup(nn.Module):
    """Rows of a tt-layout TT table: the row half's rows times the column half."""

    def __init__(self, layer: TTEmbedding):
        super().__init__()
        left, right = embedding_halves(layer.gated_cores(), layer.spec, 0)
        order = layer.row_of_token
        left = left.detach()[: layer.num_embeddings] if order is None else left.detach()[order.long()]
        self.register_buffer("left", left.clone())
        self.register_buffer("right", right.detach().clone())

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return F.embedding(indices, self.left) @ self.right


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding ``weight`` (out x in) and ``bias``, on their device and in their dtype."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                      dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


@torch.no_grad()
def pair_halves(layer: TTLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, R) of a tt-layout TTLinear, gates folded and the bond balanced (``balance_bond``)."""
    if layer.spec.layout != "tt":
        raise ValueError(expected("a TTLinear of the tt layout (a pair through one bond)", layer.spec.layout))
    return balance_bond(*tt_halves(layer.gated_cores(), layer.spec))


def pair_form(layer: TTLinear) -> FactorPair:
    left, right = pair_halves(layer)
    return FactorPair(linear_of(left.t(), None), linear_of(right.t(), layer.bias))


def merged_form(layer: TTLinear) -> nn.Linear:
    left, right = pair_halves(layer)
    return linear_of((left @ right).t(), layer.bias)


def factor_pairs(model: nn.Module) -> dict[str, TTLinear]:
    """The low-rank pairs of ``model`` by name: the layers a form is chosen for."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, TTLinear) and module.spec.layout == "tt"}


def _served(module: nn.Module, form: str) -> nn.Module | None:
    """The serving form of one compressed module, or None where it stays as it is."""
    if isinstance(module, (TTLinear, TTEmbedding)) and module.spec.layout != "tt":
        return None  # its cores, contracted as the layer does (module docstring)
    if isinstance(module, TTLinear):
        return merged_form(module) if form == "merged" else pair_form(module)
    if isinstance(module, PrunedLinear):
        return linear_of(module.gated_weight().detach(), module.bias)
    if isinstance(module, CodebookEmbedding):
        return CodebookLookup(module)
    if isinstance(module, TTEmbedding):
        return HalvesLookup(module)
    return None


@torch.no_grad()
def serving_copy(model: nn.Module, forms: dict[str, str] | None = None, default: str = "pair") -> nn.Module:
    """A copy of ``model`` in eval mode, each compressed module in its serving form (module docstring):
    each low-rank pair in ``forms[name]``, else ``default``; no parameter needs a gradient (a tracer takes
    the weights as constants)."""
    chosen = dict(forms or {})
    for name, form in [*chosen.items(), ("default", default)]:
        if form not in FORMS:
            raise ValueError(expected(f"a form in {FORMS} for {name}", form))
    served = copy.deepcopy(model).eval()
    for name, module in list(served.named_modules()):
        if not name:
            continue
        replacement = _served(module, chosen.get(name, default))
        if replacement is not None:
            set_submodule(served, name, replacement)
    return served.requires_grad_(False)
