"""Checkpoint files as transformers writes them: safetensors dtype names, file names, the shard
index and the model files beside the weights, and atomic writes of text and plots.

The lowest module of the transformers integration: saving, integer storage, streaming and the spool
all write or read these files, so what they share lives here and none imports another for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_PATTERN = "model{suffix}.safetensors"  # save_pretrained's names: model-00001-of-00003.safetensors
GENERATION_FILE = "generation_config.json"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def write_index(model: nn.Module, directory: Path, split) -> None:
    """The shard index ``save_pretrained`` writes beside sharded weights (none for a single file,
    which is model.safetensors, as save_pretrained names it)."""
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_model_files(model: nn.Module, directory: Path) -> None:
    """The files ``save_pretrained`` writes besides the weights: config.json (with the dtype and
    architecture it records) and, for generating models, generation_config.json."""
    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text file through a temporary sibling and a rename: never half-written (its folder made if
    missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_figure_atomic(figure, path: Path) -> Path:
    """Save a matplotlib figure as ``path`` (PNG) through a temporary sibling and a rename, its folder made if
    missing: a plot drawn at the end of a long run must not end it on a missing folder or a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp)
    os.replace(tmp, path)
    return path
