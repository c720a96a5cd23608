"""Integer checkpoints: factors written as integers with float16 scales, read back as floats.

Writing: every tensor ``conversion.storage.integer_axes`` names is rounded (``integer/``) and stored
as two tensors, its values under its own name and its scales under ``<name>_scale``; the rest is
written as it is. A model in memory is written here (``write_integer_checkpoint``); a streamed
conversion rounds each layer as it is spooled (``stored_entries``).

Reading: the quantizer (``quantizer.py``) sees the scales in the safetensors headers before
transformers loads anything, puts an integer buffer of the stored shape in the place of each such
parameter, and a float16 one for its scales, so that transformers loads both exactly as stored;
after loading, each pair becomes the float parameter again (dequantized on load: the model then
runs, trains and saves as a float one, and ``save_pretrained`` writes integers again).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..conversion.storage import integer_axes
from ..errors import ModelLoadError
from ..integer import IntegerFormat, dequantize, quantize
from .checkpoint_check import aliases, read_header
from .compat import saved_tensor_names
from .files import SAFETENSORS_DTYPES, SHARD_PATTERN, write_index, write_model_files

SCALE_SUFFIX = "_scale"


def stored_entries(name: str, tensor: torch.Tensor, axis: int | None, fmt: IntegerFormat) -> dict[str, torch.Tensor]:
    """What a checkpoint stores for tensor ``name``: itself (``axis`` None), or its integer values
    and, under ``<name>_scale``, its scales."""
    if axis is None:
        return {name: tensor}
    values, scales = quantize(tensor, fmt, axis, what=name)
    return {name: values, name + SCALE_SUFFIX: scales}


def with_scales(names: list[str], stored) -> list[str]:
    """``names`` with each one's scales after it, where ``stored`` (names written) has them."""
    return [entry for name in names for entry in (name, name + SCALE_SUFFIX) if entry in stored]


def write_integer_checkpoint(model: nn.Module, directory: Path, fmt: IntegerFormat,
                             max_shard_size: int | str = "50GB") -> None:
    """What ``save_pretrained(directory, max_shard_size=...)`` writes for ``model``, its factors and
    dense matrices rounded to ``fmt`` (the model itself is left as it is)."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.torch import save_file

    state, axes = model.state_dict(), integer_axes(model)
    tensors = {}
    for name in saved_tensor_names(model):
        tensors.update(stored_entries(name, state[name].detach(), axes.get(name), fmt))
    split = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda t: t.numel() * t.element_size(), filename_pattern=SHARD_PATTERN,
        max_shard_size=max_shard_size)
    write_model_files(model, directory)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous().cpu() for n in names}, str(directory / filename),
                  metadata={"format": "pt"})
    write_index(model, directory, split)


@dataclass
class _Stored:
    """A parameter that arrives as integers: where it goes back, and what it was."""

    owner: nn.Module
    attribute: str
    name: str
    shape: tuple[int, ...]
    axis: int
    dtype: torch.dtype
    requires_grad: bool
    order: list[str]  # the owner's parameter names in their order (a ParameterList's cores)


class IntegerLoading:
    """The quantizer's two steps for an integer checkpoint: ``prepare`` before transformers loads
    the weights, ``restore`` after."""

    def __init__(self, fmt: IntegerFormat):
        self.fmt = fmt
        self.stored: list[_Stored] = []

    def prepare(self, model: nn.Module, checkpoint_files) -> None:
        """Put integer buffers of the stored shapes in the place of every parameter the checkpoint
        stores as integers (those with ``<name>_scale`` beside them)."""
        header = {}
        for path in checkpoint_files:
            header.update({k: v for k, v in read_header(str(path)).items() if k != "__metadata__"})
        prefix = getattr(model, "base_model_prefix", "")
        for name, axis in integer_axes(model).items():
            scale_key = next((k for k in aliases(name + SCALE_SUFFIX, prefix) if k in header), None)
            if scale_key is None:
                continue  # stored as a float (a training checkpoint): loaded as it is
            values_key = scale_key[: -len(SCALE_SUFFIX)]
            if values_key not in header:
                raise ModelLoadError(f"the checkpoint stores scales for {values_key} but not its values: "
                                     f"the file is incomplete")
            self._make_room(model, name, axis, header[values_key], header[scale_key])

    def _make_room(self, model: nn.Module, name: str, axis: int, values: dict, scales: dict) -> None:
        module_name, _, attribute = name.rpartition(".")
        owner = model.get_submodule(module_name)
        expected = {8: "I8", 4: "U8"}[self.fmt.bits]
        if values["dtype"] != expected:
            raise ModelLoadError(f"{name} is stored as {values['dtype']}, but the checkpoint records "
                                 f"{self.fmt.name} storage ({expected} values)")
        order = next((item.order for item in self.stored if item.owner is owner), None) or list(owner._parameters)
        param = owner._parameters.pop(attribute)
        self.stored.append(_Stored(owner, attribute, name, tuple(param.shape), axis, param.dtype,
                                   param.requires_grad, order))
        device = param.device
        owner.register_buffer(attribute, torch.empty(values["shape"], dtype=SAFETENSORS_DTYPES[values["dtype"]],
                                                     device=device))
        owner.register_buffer(attribute + SCALE_SUFFIX, torch.empty(scales["shape"], dtype=torch.float16,
                                                                    device=device))

    @torch.no_grad()
    def restore(self) -> None:
        """Each integer buffer and its scales become the float parameter again."""
        for item in self.stored:
            values = item.owner._buffers.pop(item.attribute)
            scales = item.owner._buffers.pop(item.attribute + SCALE_SUFFIX)
            tensor = dequantize(values, scales, self.fmt, item.shape, item.axis, item.dtype, what=item.name)
            item.owner._parameters[item.attribute] = nn.Parameter(tensor, requires_grad=item.requires_grad)
        for item in self.stored:  # back in their order: a ParameterList's cores are read in it
            parameters = item.owner._parameters
            item.owner._parameters = {key: parameters[key] for key in item.order}
        self.stored.clear()
