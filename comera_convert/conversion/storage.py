"""How a compressed checkpoint stores its tensors (``comera convert --dtype``).

Floats: TT cores are as easy to round as dense weights: bfloat16 halves the checkpoint of a float32
source for a change in the fourth digit of the embeddings (docs/findings.md). float16 has
finer steps but a range of only +-65504, so a model holding a larger value is refused rather than
stored as infinities.

Integers (``int8``, ``int4``): every factor (TT and low-rank cores, codebook centres) and every
dense matrix left (position tables, layers kept dense) is rounded to integers with a float16 scale
per channel (int8) or per group of a channel's values (int4, 128 by default): ``integer/``. A
core's channels run along its largest bond, so each rank index of a low-rank pair (one singular
direction) gets its own scales; the values of a channel are its weights along the other axes.
Norms, biases and rank gates (vectors) stay in the model's float dtype. The checkpoint is read
back as floats (``hf/integer_storage.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..choices import FLOAT_STORAGE
from ..choices import INTEGER_STORAGE as INTEGER_BITS
from ..errors import ConfigError, expected
from ..request import check_storage_name
from ..integer import IntegerFormat, dequantize, quantize
from ..layers import CodebookEmbedding, PrunedLinear, TTModule
from ..layers.base import core_channel_axis

STORAGE_DTYPES = {name: getattr(torch, name) for name in FLOAT_STORAGE}
# int4 keeps a scale per this many values of a channel: finer groups round closer and cost more
# scale bytes (2 bytes per group: 1/64 bit per value at 128). 128 is GPTQ's and AWQ's default and
# divides every width of BERT, GPT-2 and Llama (768, 2304, 3072, 4096, 11008).
INT4_GROUP_SIZE = 128
# A float tensor smaller than this stays float (its scales would cost about what rounding saves):
# the size under which the converter keeps a layer dense too (targets.MIN_DENSE_PARAMS).
MIN_INTEGER_VALUES = 4096


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of a float ``--dtype`` name (``cast_for_storage`` takes integer names aside), or a
    ConfigError listing every name."""
    check_storage_name(name)
    return STORAGE_DTYPES[name]


def integer_format(name: str, group_size: int | None = None, clip_search: bool = True) -> IntegerFormat:
    """The IntegerFormat of ``--dtype int8|int4``: int8 a scale per channel, int4 per
    INT4_GROUP_SIZE values (fewer where a core's width is not a multiple of it), or per the
    ``group_size`` given, which must then divide every width."""
    if name not in INTEGER_BITS:
        raise ConfigError(expected(f"an integer storage dtype in {tuple(INTEGER_BITS)}", name))
    bits = INTEGER_BITS[name]
    if group_size is not None:  # as given: a width it does not divide is an error
        return IntegerFormat(bits, group_size, clip_search=clip_search)
    return IntegerFormat(bits, INT4_GROUP_SIZE if bits == 4 else None, exact=False, clip_search=clip_search)


def storage_record(name: str, group_size: int | None, clip_search: bool = True) -> dict:
    """What the checkpoint's config records of integer storage: the ``--dtype``, the group size
    requested (None: the default) and how scales are chosen, which ``integer_format`` turns back
    into the format."""
    return {"format": name, "group_size": group_size, "clip_search": clip_search}


def integer_axes(model: nn.Module) -> dict[str, int]:
    """{state-dict name: channel axis} of the model's tensors stored as integers: every TT core (its
    channels along its largest bond: the last axis of the first core, the first of the others), a
    codebook table's centres (one channel per slice) and every other float matrix of at least
    MIN_INTEGER_VALUES values (a channel per row). Vectors (norms, biases, gates) stay float, and so
    does a matrix held in two places (a dense table and the head tied to it)."""

    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    axes = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, TTModule):
            cores = [name for name, _ in module.cores.named_parameters()]
            for index, name in enumerate(cores):
                axes[f"{prefix}cores.{name}"] = core_channel_axis(index, module.cores[index])
        for name, param in module.named_parameters(recurse=False):
            full = f"{prefix}{name}"
            if full in axes or not param.is_floating_point() or param.dim() < 2 or uses[id(param)] > 1:
                continue
            if param.numel() >= MIN_INTEGER_VALUES or isinstance(module, CodebookEmbedding):
                axes[full] = 0
    return axes


def integer_storage(dtype: str | None, group_size: int | None = None) -> IntegerFormat | None:
    """The IntegerFormat a ``--dtype`` asks the checkpoint to store its factors in, or None (floats)."""
    return integer_format(dtype, group_size) if dtype in INTEGER_BITS else None


@torch.no_grad()
def round_in_place(module: nn.Module, fmt: IntegerFormat, module_name: str = "") -> None:
    """Replace each of ``module``'s tensors that integer storage rounds by what the checkpoint will
    hold, so that a conversion fits the layers after it to the rounded ones (as GPTQ feeds each
    rounding error forward). Writing it later rounds to the same values. ``module_name`` names the
    module in messages."""
    for name, axis in integer_axes(module).items():
        param = module.get_parameter(name)
        if param.is_meta:
            continue  # a streamed conversion's layer written out already (rounded as it was written)
        what = f"{module_name}.{name}" if module_name else name
        values, scales = quantize(param, fmt, axis, what=what)
        param.copy_(dequantize(values, scales, fmt, param.shape, axis, param.dtype))


def train_on_the_grid(model: nn.Module, fmt: IntegerFormat | None) -> None:
    """Make every TT layer, codebook table and pruned linear that integer storage rounds run on its
    factors rounded to ``fmt`` (None: on the floats again): training then learns what integer
    storage keeps."""
    rounded = integer_axes(model)
    for name, module in model.named_modules():
        if isinstance(module, (TTModule, CodebookEmbedding)):
            module.integer_format = fmt
            module.clear_cache()  # what inference built from the weights before they were rounded
        elif isinstance(module, PrunedLinear) and (f"{name}.weight" if name else "weight") in rounded:
            module.integer_format = fmt  # a scale per row, as integer_axes stores it


@torch.no_grad()
def cast_for_storage(model: nn.Module, name: str) -> None:
    """Cast the model's floating-point parameters and buffers to dtype ``name``, in place; refuse a
    dtype whose range cannot hold the model's values. Integer storage casts nothing: the writer
    rounds (``hf/integer_storage.py``)."""
    if name in INTEGER_BITS:
        return
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
