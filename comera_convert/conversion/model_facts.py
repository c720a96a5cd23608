"""What the conversion reads off a model before and after: its parameter count and its input table."""

from __future__ import annotations

from torch import nn

from ..layers import CodebookEmbedding


def count_params(model: nn.Module) -> int:
    """Parameters of the model, each shared tensor counted once; a codebook table's codes count as
    the parameters they weigh as much as (``CodebookEmbedding.stored_params``)."""
    codes = sum(m.stored_params() - m.codebooks.numel() for m in model.modules() if isinstance(m, CodebookEmbedding))
    return sum(p.numel() for p in model.parameters()) + codes


def input_embedding_names(model: nn.Module, candidates) -> frozenset[str]:
    """The candidates that are the model's input embedding (none where it has no such accessor)."""
    try:
        table = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return frozenset()
    return frozenset(c.name for c in candidates if c.module is table)
