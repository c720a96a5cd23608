"""Streaming conversion: a model converted without ever holding its dense weights all at once.

The skeleton is built on the meta device (parameters without storage; buffers real, since many are
computed at construction, such as rotary frequencies), the conversion is planned on it as usual,
and each layer's dense weight is read from the source's safetensors files (by the offsets in their
headers, tensor by tensor) just before that layer is decomposed, then dropped. The compressed model
does not pile up either: each converted layer is written to a spool file and freed (``spool.py``),
and the checkpoint is assembled from the spool at the end. A calibrated conversion streams the
same way, its statistics gathered block by block (``sequential.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..conversion.storage import cast_for_storage, integer_axes
from ..errors import ModelLoadError
from ..hf.checkpoint_check import aliases, read_header_and_start
from ..hf.compat import retie_dense_heads
from ..hf.files import GENERATION_FILE, INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE
from ..hf.integer_storage import stored_entries
from ..models import auto_class_for, read_config
from .spool import WeightSpool


class SafetensorsSource:
    """A checkpoint's tensors by name, read one at a time from its safetensors file(s) by the
    offsets in their headers."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.entries = {}  # tensor name -> (file, where its data starts, its header entry)
        for file in self._weight_files():
            # A truncated or corrupted shard fails here, in one line.
            header, start = read_header_and_start(str(file))
            for name, entry in header.items():
                if name != "__metadata__":
                    self.entries[name] = (file, start, entry)

    def _weight_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError) as err:
                raise ModelLoadError(f"{index} is not a shard index ({err})") from None
            missing = [n for n in names if not (self.directory / n).is_file()]
            if missing:
                raise ModelLoadError(f"{index} names {', '.join(missing)}, which {self.directory} does not have: "
                                     f"the checkpoint is incomplete")
            return [self.directory / n for n in names]
        if (self.directory / SINGLE_FILE).is_file():
            return [self.directory / SINGLE_FILE]
        raise ModelLoadError(f"{self.directory} has no safetensors weights to stream")

    def tensor(self, name: str, prefix: str = "") -> torch.Tensor:
        """The stored tensor of a parameter name, across the base-model prefix (``bert.`` or not), read
        into memory of its own (not a mapping of the file: mapped pages would count as the process's
        memory until the file is closed, the whole checkpoint by the end)."""
        for key in aliases(name, prefix):
            if key in self.entries:
                return self._read(*self.entries[key])
        raise ModelLoadError(f"the checkpoint in {self.directory} does not store {name}")

    @staticmethod
    def _read(file: Path, start: int, entry: dict) -> torch.Tensor:
        begin, end = entry["data_offsets"]
        raw = torch.empty(end - begin, dtype=torch.uint8)
        with file.open("rb") as handle:
            handle.seek(start + begin)
            handle.readinto(memoryview(raw.numpy()))
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{file}: tensors of dtype {entry['dtype']} cannot be streamed")
        return raw.view(dtype).reshape(entry["shape"])

    def has(self, name: str, prefix: str = "") -> bool:
        return any(k in self.entries for k in aliases(name, prefix))


def meta_skeleton(cls, config, dtype: torch.dtype) -> nn.Module:
    """The model's modules with parameters on the meta device and real buffers."""
    from accelerate import init_empty_weights

    build = getattr(cls, "_from_config", None) or cls.from_config  # a model class, or an Auto class
    with init_empty_weights(include_buffers=False):
        model = build(config, dtype=dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # a tied head shares its embedding's (meta) parameter, as once loaded
    return model.eval()


def load_module(model: nn.Module, name: str, source: SafetensorsSource) -> None:
    """Give module ``name``'s own parameters their stored values (it was on the meta device)."""
    module = model.get_submodule(name)
    for param_name, param in list(module.named_parameters(recurse=False)):
        if param.is_meta:
            _load_parameter(model, module, param_name, f"{name}.{param_name}", source)


def _load_parameter(model: nn.Module, module: nn.Module, param_name: str, full_name: str,
                    source: SafetensorsSource) -> None:
    """Replace ``module``'s meta parameter by one holding the stored value, in the parameter's dtype."""
    param = getattr(module, param_name)
    value = source.tensor(full_name, getattr(model, "base_model_prefix", "")).to(param.dtype)
    setattr(module, param_name, nn.Parameter(value, requires_grad=param.requires_grad))


def load_the_rest(model: nn.Module, source: SafetensorsSource, skip=lambda name: False, after=None) -> None:
    """Every parameter still on the meta device (layers left dense, norms, biases) gets its stored
    value, but those ``skip(name)`` is true for (written out already, or not needed yet); a tied
    output layer is tied again to its (now real) input embedding. ``after(module name)`` is called
    once a module's parameters are read (streaming writes it out before reading the next)."""
    prefix = getattr(model, "base_model_prefix", "")
    tied = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    for name, module in model.named_modules():
        loaded = False
        for param_name, param in list(module.named_parameters(recurse=False)):
            full = f"{name}.{param_name}" if name else param_name
            if not param.is_meta or skip(full):
                continue
            if full in tied and not source.has(full, prefix):
                continue  # tied to another parameter: retie_dense_heads below
            _load_parameter(model, module, param_name, full, source)
            loaded = True
        if loaded and after is not None:
            after(name)
    waiting = retie_dense_heads(model)
    still_meta = [n for n, p in model.named_parameters() if p.is_meta and not skip(n) and n not in waiting]
    if still_meta:
        raise ModelLoadError(f"the checkpoint stores no value for {', '.join(still_meta[:3])}"
                             + (f" and {len(still_meta) - 3} more" if len(still_meta) > 3 else ""))


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    return library if library is not None and hasattr(library, "malloc_trim") else None


def give_back_free_memory() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim; a no-op elsewhere). Each
    layer's tensors are freed, but glibc keeps the pages for reuse, and tensors of ever-different
    sizes leave them unused: measured on a 1.1 B model, resident memory grew by about one dense
    layer per layer converted (0.4 -> 2.5 GB) without this, and stays flat with it."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def streamable(path: str) -> bool:
    """A local checkpoint folder with safetensors weights (a single file or an index)."""
    folder = Path(path)
    return folder.is_dir() and ((folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file())


class Streamed:
    """One streaming conversion: the source's tensors, the skeleton, the per-layer loader."""

    def __init__(self, path: str):
        self.path = path
        self.source = SafetensorsSource(path)
        self.spool = None
        self.storage_dtype = None
        self.integer_format = None

    def skeleton(self, task: str | None = None) -> nn.Module:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path)
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        model = meta_skeleton(auto_class_for(read_config(self.path), task), config, dtype)
        if (Path(self.path) / GENERATION_FILE).is_file() and getattr(model, "generation_config", None) is not None:
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(self.path)  # as from_pretrained reads it
        return model

    def missing(self, model: nn.Module) -> list[str]:
        """Parameters of the skeleton the files do not store under the same name (a checkpoint whose
        names transformers converts on load, such as ``gamma`` for ``weight``): such a model is
        loaded whole instead."""
        prefix = getattr(model, "base_model_prefix", "")
        tied = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
        return [name for name, _ in model.named_parameters(remove_duplicate=False)
                if name not in tied and not self.source.has(name, prefix)]

    def load(self, model: nn.Module, name: str) -> None:
        """Module ``name``'s weights read, just before it is decomposed."""
        load_module(model, name, self.source)

    def open_spool(self, out: Path, storage_dtype: str | None = None, integer_format=None) -> None:
        """Converted layers will be written to a hidden spool file beside ``out`` (cast to the float
        ``storage_dtype`` first, or rounded to ``integer_format``, when given) and freed; ``close``
        removes it."""
        out.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{out.name}.spool-", dir=out.parent)
        os.close(handle)
        self.spool, self.storage_dtype, self.integer_format = WeightSpool(name), storage_dtype, integer_format

    def spill(self, model: nn.Module, name: str) -> None:
        """Write module ``name`` (cast to the storage dtype) to the spool and free its memory."""
        if self.storage_dtype is not None:
            cast_for_storage(model.get_submodule(name), self.storage_dtype)
        stored = None
        if self.integer_format is not None:
            axes, fmt = integer_axes(model), self.integer_format
            stored = lambda tensor_name, tensor: stored_entries(tensor_name, tensor, axes.get(tensor_name), fmt)  # noqa: E731
        self.spool.spill(model, name, stored)
        give_back_free_memory()

    def finish(self, model: nn.Module) -> None:
        """Read what was not converted (norms, biases, layers left dense) a module at a time, each
        spooled before the next is read, and whatever else the model holds (buffers)."""
        load_the_rest(model, self.source, skip=self.spool.entries.__contains__,
                      after=lambda name: self.spill(model, name))
        self.spill(model, "")

    def writer(self, model: nn.Module, max_shard_size: int | str | None):
        """The weight writer ``save_compressed`` calls: the spooled checkpoint, sharded as requested."""
        sharding = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        return lambda directory: self.spool.write_checkpoint(model, directory, **sharding)

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()
