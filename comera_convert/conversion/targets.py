"""Which modules of a model get compressed: a generic walk of the module tree.

Every nn.Linear, transformers Conv1D (GPT-2's transposed linear) and nn.Embedding is a
candidate; ``targets`` / ``exclude`` take module-name patterns (globs such as
``encoder.layer.*.attention.*``, or a plain name component such as ``query``). A linear whose
weight is the very tensor of an embedding (a tied LM head) is never converted on its own: it
follows its embedding (see ``converter.py``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from ..errors import ConfigError

# A layer smaller than this stays dense: its TT cores would cost about as much as the matrix,
# and the reshapes cost more time than the GEMM they replace.
MIN_DENSE_PARAMS = 4096


@dataclass
class Candidate:
    """A module the converter may replace."""

    name: str
    module: nn.Module
    kind: str  # "linear" or "embedding"
    rows: int  # rows of the TT matrix: in_features, or num_embeddings
    cols: int  # columns: out_features, or embedding_dim

    @property
    def dense_params(self) -> int:
        return self.rows * self.cols


@dataclass
class TiedHead:
    """A linear head whose weight is the weight of an embedding (kept tied, never duplicated)."""

    name: str
    module: nn.Module
    embedding_name: str


def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def _shape_of(module: nn.Module):
    if isinstance(module, nn.Embedding):
        return "embedding", module.num_embeddings, module.embedding_dim
    if isinstance(module, nn.Linear):
        return "linear", module.in_features, module.out_features
    if is_conv1d(module):
        return "linear", module.weight.shape[0], module.weight.shape[1]
    return None


def matches(name: str, pattern: str) -> bool:
    """A glob over the full module name, or an exact match of one of its dot-separated parts."""
    return fnmatch.fnmatchcase(name, pattern) or pattern in name.split(".")


def _too_small(rows: int, cols: int, d: int) -> str | None:
    if rows * cols < MIN_DENSE_PARAMS:
        return f"{rows} x {cols} is below {MIN_DENSE_PARAMS} weights"
    for size in (rows, cols):
        if size < 2 ** d:
            return f"dimension {size} cannot split into {d} modes"
    return None


def find_candidates(model: nn.Module, targets=None, exclude=None, d: int = 3):
    """Walk the model: (candidates, tied heads, skipped {name: reason}).

    Raises ConfigError for a targets/exclude pattern that matches no candidate module.
    """
    embedding_of_weight = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            embedding_of_weight[id(module.weight)] = name

    candidates, tied, skipped, seen_names = [], [], {}, []
    for name, module in model.named_modules():
        shape = _shape_of(module)
        if shape is None or not name:
            continue
        seen_names.append(name)
        kind, rows, cols = shape
        if kind == "linear" and id(module.weight) in embedding_of_weight:
            tied.append(TiedHead(name, module, embedding_of_weight[id(module.weight)]))
            continue
        if targets and not any(matches(name, p) for p in targets):
            skipped[name] = "not in targets"
            continue
        if exclude and any(matches(name, p) for p in exclude):
            skipped[name] = "excluded"
            continue
        reason = _too_small(rows, cols, d)
        if reason:
            skipped[name] = reason
            continue
        candidates.append(Candidate(name, module, kind, rows, cols))

    for option, patterns in (("--targets", targets), ("--exclude", exclude)):
        for pattern in patterns or ():
            if not any(matches(n, pattern) for n in seen_names):
                examples = ", ".join(seen_names[:4])
                raise ConfigError(f"{option} pattern {pattern!r} matches no Linear or Embedding module "
                                  f"(module names look like: {examples})")
    return candidates, tied, skipped


# The attention block's output projection, by the names transformers' architectures give it (BERT and
# RoBERTa, GPT-2, Llama and Mistral, OPT and BART, GPT-NeoX, MPNet): a name ends in one of these.
ATTENTION_OUTPUT_NAMES = ("attention.output.dense", "attn.c_proj", "self_attn.o_proj", "self_attn.out_proj",
                          "attention.dense", "attention.attn.o")


def attention_output_in(names, block_prefix: str) -> str | None:
    """The first of ``names`` that is an attention output projection inside the block named by
    ``block_prefix`` (``encoder.layer.5.``), or None."""
    return next((name for name in names if name.startswith(block_prefix)
                 and name.endswith(ATTENTION_OUTPUT_NAMES)), None)


def find_blocks(model: nn.Module) -> str | None:
    """The name of the model's stack of repeated blocks: the ModuleList of two or more modules of
    one class that holds the most parameters (``model.layers``, ``bert.encoder.layer``,
    ``transformer.h``), or None."""
    best, most = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size > most:
                best, most = name, size
    return best


def last_block_prefix(model: nn.Module) -> str | None:
    """The module-name prefix of the model's last repeated block (``encoder.layer.5.``), or None."""
    stack = find_blocks(model)
    if stack is None:
        return None
    last = len(model.get_submodule(stack)) - 1
    return f"{stack}.{last}." if stack else f"{last}."
