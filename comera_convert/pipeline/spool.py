"""A compressed model written out as it is made: each converted layer's tensors go to a spool file
the moment the layer is done, and leave memory; at the end they are copied into safetensors shards.

Streaming conversion (``streaming.py``) reads one dense layer at a time; without the spool the
compressed result would still pile up in memory until ``save_pretrained`` (a quarter of the
checkpoint at --ratio 4). ``WeightSpool.write_checkpoint`` writes what ``save_pretrained`` writes
(config, generation config, the weights under the names it would choose, sharded the same way)
while holding at most one tensor at a time; the copy runs through a small buffer.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..hf.compat import saved_tensor_names
from ..hf.integer_storage import with_scales
from ..hf.files import SAFETENSORS_DTYPES, SHARD_PATTERN, write_index, write_model_files

DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
COPY_BLOCK = 16 * 2 ** 20  # bytes moved from the spool to a shard per read: memory stays flat


@dataclass(frozen=True)
class Spooled:
    """Where one tensor lies in the spool file."""

    offset: int
    nbytes: int
    dtype: str  # the safetensors name: BF16, F32, I64, ...
    shape: tuple[int, ...]


class WeightSpool:
    """Tensors by state-dict name, moved out of memory into one file as they are produced."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.handle = self.path.open("w+b")
        self.entries: dict[str, Spooled] = {}

    def spill(self, model: nn.Module, module_name: str = "", stored=None) -> None:
        """Write every tensor of ``model``'s submodule ``module_name`` (the whole model for "") that
        is not on the meta device to the spool, then move the module to the meta device.
        ``stored(name, tensor)``, when given, says what to write for each tensor ({name: tensor}:
        integer storage writes values and scales)."""
        module = model.get_submodule(module_name)
        prefix = f"{module_name}." if module_name else ""
        for local_name, tensor in module.state_dict(keep_vars=True).items():
            name = f"{prefix}{local_name}"
            if tensor.is_meta or name in self.entries:
                continue
            for entry, value in (stored(name, tensor.detach()) if stored else {name: tensor.detach()}).items():
                self._write(entry, value)
        to_meta(module)

    def _write(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in DTYPE_NAMES:
            raise ConfigError(f"{name} is {tensor.dtype}, which a safetensors checkpoint written here cannot hold "
                              f"(expected one of {', '.join(str(d) for d in DTYPE_NAMES)})")
        data = tensor.contiguous().cpu().reshape(-1).view(torch.uint8)
        self.handle.seek(0, 2)
        offset = self.handle.tell()
        self.handle.write(memoryview(data.numpy()))
        self.entries[name] = Spooled(offset, data.numel(), DTYPE_NAMES[tensor.dtype], tuple(tensor.shape))

    def close(self) -> None:
        self.handle.close()
        self.path.unlink(missing_ok=True)

    def write_checkpoint(self, model: nn.Module, directory: Path, max_shard_size: int | str = "50GB") -> None:
        """What ``save_pretrained(directory, max_shard_size=...)`` writes for ``model``, whose tensors
        are all spooled (every parameter is on the meta device)."""
        from huggingface_hub import split_state_dict_into_shards_factory

        names = saved_tensor_names(model)
        unspooled = [n for n in names if n not in self.entries]
        if unspooled:
            raise RuntimeError(f"the spool lacks {', '.join(unspooled[:3])}: spill every module before writing")
        names = with_scales(names, self.entries)  # an integer tensor's scales follow it
        split = split_state_dict_into_shards_factory(
            {name: self.entries[name] for name in names}, get_storage_size=lambda entry: entry.nbytes,
            filename_pattern=SHARD_PATTERN, max_shard_size=max_shard_size)
        write_model_files(model, directory)
        self.handle.flush()
        for filename, tensor_names in split.filename_to_tensors.items():
            self._write_shard(directory / filename, tensor_names)
        write_index(model, directory, split)

    def _write_shard(self, path: Path, names: list[str]) -> None:
        # Widest elements first, as safetensors orders them, so every tensor starts aligned.
        order = sorted(names, key=lambda n: (-SAFETENSORS_DTYPES[self.entries[n].dtype].itemsize, n))
        header, position = {"__metadata__": {"format": "pt"}}, 0
        for name in order:
            entry = self.entries[name]
            header[name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                            "data_offsets": [position, position + entry.nbytes]}
            position += entry.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts on an 8-byte boundary
        with path.open("wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for name in order:
                self._copy(self.entries[name], out)

    def _copy(self, entry: Spooled, out) -> None:
        self.handle.seek(entry.offset)
        left = entry.nbytes
        while left:
            block = self.handle.read(min(left, COPY_BLOCK))
            out.write(block)
            left -= len(block)


def to_meta(module: nn.Module) -> None:
    """Move a module's tensors to the meta device, keeping shared parameters shared (``module.to``
    would give each place a parameter is used a meta parameter of its own, and tied weights, such as
    BERT's decoder bias, would no longer look tied when the names to save are chosen)."""
    replace_tensors(module, lambda p: p if p.is_meta else meta_parameter(p),
                    lambda b: b if b.is_meta else b.to("meta"))


def replace_tensors(module: nn.Module, parameter, buffer=None) -> None:
    """Put ``parameter(p)`` in place of every parameter p of ``module`` (and ``buffer(b)`` of every
    buffer, when given); a tensor held in several places is replaced once, so tied ones stay tied."""
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for slots, make in ((sub._parameters, parameter), (sub._buffers, buffer)):
            for key, tensor in slots.items():
                if tensor is not None and make is not None:
                    if id(tensor) not in made:
                        made[id(tensor)] = make(tensor)
                    slots[key] = made[id(tensor)]


def meta_parameter(param: nn.Parameter) -> nn.Parameter:
    """A parameter of ``param``'s shape and dtype on the meta device (no storage)."""
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


