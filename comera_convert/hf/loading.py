"""Opening compressed checkpoints: comera_convert.from_pretrained, and decompression to dense."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..errors import ModelLoadError
from ..layers import CodebookEmbedding, PrunedLinear, TiedTTHead, TTEmbedding, TTLinear
from ..layers.swap import set_submodule
from ..models import load_model, read_config, resolve
from .checkpoint_check import read_header
from .compat import forget_compression
from .config import QUANT_METHOD, compression_of


def is_compressed_dir(path: str | os.PathLike) -> bool:
    return compression_of(read_config(str(path))) is not None


def from_pretrained(path: str | os.PathLike, task: str | None = None, **kwargs):
    """Load a compressed checkpoint as the transformers class it was saved from.

    ``task`` ("base", "mlm", "clm", "seq-cls") picks an Auto class instead; ``kwargs`` go to
    transformers' ``from_pretrained`` (dtype, device_map, ...).
    """
    resolved = resolve(str(path))
    if not is_compressed_dir(resolved):
        raise ModelLoadError(f"{path} is not a comera compressed checkpoint (its config.json has no "
                             f"quantization_config with quant_method {QUANT_METHOD!r}): "
                             f"convert it with `comera convert`")
    weights = Path(resolved) / "model.safetensors"
    if weights.is_file():
        read_header(str(weights))  # a truncated or corrupted file fails here, in one line
    model, _ = load_model(resolved, task=task, **kwargs)
    return model


@torch.no_grad()
def dense_linear(module) -> nn.Module:
    """The dense layer a TTLinear represents, of the class it was converted from (nn.Linear, or
    transformers' Conv1D, whose weight is stored in x out), sharing the TTLinear's bias."""
    weight = module.dense_weight()
    if module.dense_class == "Conv1D":
        from transformers.pytorch_utils import Conv1D

        dense = Conv1D(module.out_features, module.in_features).to(weight)
        dense.weight.copy_(weight.t())
    else:
        dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          device=weight.device, dtype=weight.dtype)
        dense.weight.copy_(weight)
    if module.bias is not None:
        dense.bias = module.bias
    return dense


def _dense_embedding(module) -> nn.Embedding:
    table = module.dense_matrix()
    dense = nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx,
                         device=table.device, dtype=table.dtype)
    dense.weight.copy_(table)
    return dense


@torch.no_grad()
def decompress_model(model: nn.Module) -> nn.Module:
    """Replace every TT module by the dense module it represents (in place), and forget the compression.

    A head tied to a converted embedding becomes a Linear tied to the dense embedding again.
    """
    name_of = {id(m): n for n, m in model.named_modules()}
    heads = []
    for name, module in list(model.named_modules()):
        if isinstance(module, TTLinear):
            set_submodule(model, name, dense_linear(module))
        elif isinstance(module, PrunedLinear):
            set_submodule(model, name, module.expanded())
        elif isinstance(module, (TTEmbedding, CodebookEmbedding)):
            set_submodule(model, name, _dense_embedding(module))
        elif isinstance(module, TiedTTHead):
            heads.append((name, module, name_of[id(module.embedding)]))
    for name, head, embedding_name in heads:
        embedding = model.get_submodule(embedding_name)
        linear = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None,
                           device=embedding.weight.device, dtype=embedding.weight.dtype)
        linear.weight = embedding.weight
        if head.bias is not None:
            linear.bias = head.bias
        set_submodule(model, name, linear)
    forget_compression(model)
    return model
