"""Check a checkpoint's tensors against the model it is about to load into, before loading.

Reads only the safetensors headers (JSON), so a compressed checkpoint whose recorded ranks
disagree with its tensors, or a truncated file, fails with a clear message instead of loading
a model with some weights silently left random.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from ..conversion.records import tensor_shapes
from ..errors import ModelLoadError
from ..layers import CodebookEmbedding, TTEmbedding, TTModule

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def read_header(path: str) -> dict:
    """The safetensors header of ``path``: {name: {"dtype", "shape", "data_offsets"}, "__metadata__"}."""
    return read_header_and_start(path)[0]


def read_header_and_start(path: str) -> tuple[dict, int]:
    """The header of ``path`` and the byte where its tensor data starts (data_offsets count from there)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelLoadError(f"{path} is not a safetensors file (only {size} bytes)")
            (length,) = struct.unpack("<Q", raw)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ModelLoadError(f"{path} is truncated or corrupted (its header claims {length} bytes)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing: the checkpoint is incomplete (its config or shard index "
                             f"names this file)") from None
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise ModelLoadError(f"{path} is truncated: its tensors need {8 + length + end} bytes, the file has {size}")
    return header, 8 + length


def stored_shapes(checkpoint_files) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in checkpoint_files:
        header = read_header(path)
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def aliases(key: str, prefix: str) -> list[str]:
    """A key as a head model stores it and as its base model does (``bert.`` prefix or not)."""
    if not prefix:
        return [key]
    return [key, f"{prefix}.{key}", key.removeprefix(prefix + ".")]


def check_row_orders(model) -> None:
    """Refuse a reordered embedding whose stored ``row_of_token`` is not a permutation of its token
    ids (a table from another vocabulary, or a damaged file): it would load with its rows shuffled."""
    for name, module in model.named_modules():
        rows = getattr(module, "row_of_token", None) if isinstance(module, TTEmbedding) else None
        if rows is None or rows.is_meta:
            continue
        size = module.num_embeddings
        if rows.shape != (size,) or not torch.equal(torch.sort(rows.long().cpu()).values, torch.arange(size)):
            raise ModelLoadError(f"{name}.row_of_token is not a permutation of the {size} token ids: the checkpoint's "
                                 f"row order does not belong to this vocabulary (refused rather than loaded with "
                                 f"its rows shuffled)")


def check_codes(model) -> None:
    """Refuse a codebook table whose stored codes name centres its codebooks do not have (a damaged
    file, or codes of another table): the rows would be read from the wrong centres."""
    for name, module in model.named_modules():
        if not isinstance(module, CodebookEmbedding) or module.codes.is_meta:
            continue
        highest = int(module.codes.max()) if module.codes.numel() else 0
        if highest >= module.spec.codewords:
            raise ModelLoadError(f"{name}.codes names centre {highest}, but its codebooks hold "
                                 f"{module.spec.codewords}: the checkpoint's codes do not belong to its codebooks")


def check_tensors_match(model, checkpoint_files) -> None:
    """Every TT tensor the model expects is stored, with the recorded shape."""
    stored = stored_shapes(checkpoint_files)
    prefixes = [name + "." for name, m in model.named_modules() if isinstance(m, (TTModule, CodebookEmbedding))]
    prefix = getattr(model, "base_model_prefix", "")
    for key, shape in tensor_shapes(model).items():
        if not any(key.startswith(p) for p in prefixes):
            continue
        found = next((stored[k] for k in aliases(key, prefix) if k in stored), None)
        if found is None:
            raise ModelLoadError(f"the checkpoint records {key} but does not store it: the file is incomplete")
        if found != shape:
            raise ModelLoadError(f"the checkpoint's recorded ranks disagree with its tensors: {key} should be "
                                 f"{shape} by the config, the file stores {found}")
