"""How hard a --ratio cuts a model's factorized layers: what the conversion's defaults follow.

A ratio means different things on different shapes. all-MiniLM-L6-v2 keeps half of its weights
in its word table, which a codebook holds 14x smaller, so at --ratio 4 its other layers shrink
only 2.3x; a 768-wide encoder (bert-base's shape) keeps a fifth in its table, so at --ratio 4 its
other layers shrink 3.4x, and at --ratio 2 1.6x, as hard as MiniLM's at --ratio 3. Error
compensation and block reconstruction were chosen on MiniLM by ratio; with a codebook table they
follow this cut instead, so that a model gets the conversion measured where its layers are cut as
hard (``plan.py``).

    layers_cut = dense weights of the factorized layers / what the ratio's budget leaves them

where the budget is the model's parameters over the ratio, less every weight the conversion keeps
as it is and the codebook table's fixed size.
"""

from __future__ import annotations

import math

from torch import nn

from ..codebook import CodebookSpec
from .model_facts import count_params, input_embedding_names
from .targets import find_candidates


def layers_cut(model: nn.Module, ratio: float, *, d: int, targets=None, exclude=None,
               codebook: bool = True, codebook_width: int = 4) -> float:
    """The ratio by which ``model``'s factorized layers (every candidate but a codebook table) must
    shrink for the whole model to shrink ``ratio`` times: 1.0 where there are none; inf where the
    budget cannot hold what stays as it is (the allocation then says which ratio can be reached).
    ``codebook``: the input embedding is a codebook table of ``codebook_width`` columns per slice
    (its size fixed)."""
    total = count_params(model)
    candidates = find_candidates(model, targets, exclude, d)[0]
    names = input_embedding_names(model, candidates) if codebook else frozenset()
    tables = [c for c in candidates if c.name in names]
    factorized = sum(c.dense_params for c in candidates if c.name not in names)
    kept = total - factorized - sum(c.dense_params for c in tables)
    budget = total / ratio - kept - sum(_codebook_params(c, codebook_width) for c in tables)
    if budget <= 0:
        return math.inf
    return factorized / budget if factorized else 1.0


def _codebook_params(candidate, width: int) -> int:
    element_size = candidate.module.weight.element_size()
    return CodebookSpec.plan(candidate.rows, candidate.cols, width, element_size).stored_params
