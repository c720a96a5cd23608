"""The dtype a compressed checkpoint is stored in (``comera convert --dtype``).

TT cores are as easy to round as dense weights: bfloat16 halves the checkpoint of a float32 source
for a change in the fourth digit of the embeddings (BENCHMARKS.md, Quality). float16 has finer
steps but a range of only +-65504, so a model holding a larger value is refused rather than stored
as infinities.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name, or a ConfigError listing the names."""
    if name not in STORAGE_DTYPES:
        raise ConfigError(f"--dtype {name!r} is not a storage dtype "
                          f"(expected one of {', '.join(STORAGE_DTYPES)})")
    return STORAGE_DTYPES[name]


@torch.no_grad()
def cast_for_storage(model: nn.Module, name: str) -> None:
    """Cast the model's floating-point parameters and buffers to dtype ``name``, in place; refuse a
    dtype whose range cannot hold the model's values."""
    dtype = storage_dtype(name)
    limit = torch.finfo(dtype).max
    for tensor_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and tensor.numel() and not tensor.is_meta:  # meta: spooled already
            largest = float(tensor.detach().abs().max())
            if largest > limit:
                raise ConfigError(f"--dtype {name} cannot hold {tensor_name} (largest magnitude "
                                  f"{largest:.3g}, {name} stops at {limit:.3g}): use bfloat16 or float32")
    model.to(dtype)
    if getattr(model, "config", None) is not None:
        model.config.dtype = dtype
