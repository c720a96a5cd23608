"""A sentence-transformers checkpoint's module list (modules.json), read without loading the model.

Three uses: a sentence-transformers folder converts as its encoder (``sentence_task``), as
sentence-transformers loads it; a conversion refuses, before the slow part, a source whose modules.json is not a list
of modules or names a module class that does not exist (sentence-transformers would fail on the
compressed checkpoint only when someone loads it); and `comera eval` pools token states the way
the source's Pooling module says (mean, CLS, max, last token, mean times sqrt(length)).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError

MODULES_FILE = "modules.json"
POOLING_FILE = "config.json"
# sentence-transformers 2-4 stored one flag per mode; 5 and later store "pooling_mode": name(s).
POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_lasttoken": "lasttoken"}
POOLING_NAMES = {"cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken"}


@dataclass
class SentencePipeline:
    """What `comera eval` needs of a sentence-transformers model: how token states are pooled."""
    pooling: str = "mean"
    normalize: bool = False


def read_modules(directory) -> list[dict] | None:
    """The module entries of ``directory``'s modules.json, None without one; a file that is not a
    list of modules with a type and a path is a one-line error."""
    path = Path(directory) / MODULES_FILE
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is not readable JSON ({err}): sentence-transformers could not load it") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                and isinstance(m.get("path", ""), str) for m in modules):
        raise ConfigError(f"{path}: expected a list of modules, each with a \"type\" and a \"path\"")
    return modules


def sentence_task(directory) -> str | None:
    """"base" for a sentence-transformers folder (sentence-transformers loads its transformer with
    AutoModel, whatever head the config records: a checkpoint saved from BertForMaskedLM embeds
    sentences with BertModel), None for any other."""
    return "base" if read_modules(directory) else None


def check_modules(directory) -> None:
    """Refuse a modules.json naming a module class that does not exist (where sentence-transformers
    is installed to tell; without it only the file's shape is checked)."""
    modules = read_modules(directory)
    if not modules:
        return
    try:
        importlib.import_module("sentence_transformers")
    except ImportError:
        return
    for module in modules:
        if not _importable(module["type"]):
            raise ConfigError(f"{Path(directory) / MODULES_FILE} names the module {module['type']!r}, which "
                              f"sentence-transformers does not have: fix or remove the entry")


def _importable(dotted: str) -> bool:
    module_name, _, attribute = dotted.rpartition(".")
    if not module_name:
        return False
    try:
        return hasattr(importlib.import_module(module_name), attribute)
    except ImportError:
        return False


def read_pipeline(directory) -> SentencePipeline | None:
    """The pooling and normalization of a sentence-transformers checkpoint, None if it is not one."""
    modules = read_modules(directory)
    if not modules:
        return None
    pipeline = SentencePipeline()
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Pooling":
            pipeline.pooling = _pooling_mode(Path(directory) / module.get("path", "") / POOLING_FILE)
        elif kind == "Normalize":
            pipeline.normalize = True
    return pipeline


def _pooling_mode(config_path: Path) -> str:
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return "mean"  # sentence-transformers' own default
    mode = config.get("pooling_mode")
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else None
    if mode is None:
        chosen = [name for flag, name in POOLING_FLAGS.items() if config.get(flag)]
        mode = chosen[0] if len(chosen) == 1 else ("mean" if not chosen else None)
    if mode not in POOLING_NAMES:
        raise ConfigError(f"{config_path}: comera eval pools one way at a time ({', '.join(sorted(POOLING_NAMES))}), "
                          f"this asks for {config.get('pooling_mode', 'several')!r}")
    return mode


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str = "mean") -> torch.Tensor:
    """Sentence embeddings of token states (batch x tokens x hidden) under an attention mask."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    if mode == "lasttoken":  # the last attended token of each row (right padding)
        last = mask.long().sum(dim=1).clamp(min=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    total = (hidden * weights).sum(dim=1)
    count = weights.sum(dim=1).clamp(min=1e-9)
    return total / count if mode == "mean" else total / count.sqrt()


@torch.no_grad()
def sentence_embeddings(model, batch, pooling: str = "mean") -> torch.Tensor:
    """Pooled last hidden states of a batch (input_ids, attention_mask) of a transformers model (its
    base model when it has a head), autograd off."""
    base = getattr(model, "base_model", model)
    hidden = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return pool(hidden.float(), batch["attention_mask"], pooling)
