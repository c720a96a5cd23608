"""TiedTTHead: an output projection tied to a compressed embedding (logits = x E^T + b).

Language-model heads (BERT's decoder, GPT-2's lm_head) share their weight with the input
embedding. When the embedding becomes a TTEmbedding the head keeps sharing it: it holds no cores
of its own. Over a CodebookEmbedding (the converter's default table, tied heads included) it
multiplies by the table the codes and centres make, built each training step (the centres learn
from the head too) and once per state of the weights in inference. Over a tt
layout it runs the input through the embedding's two halves, transposed; over ttm it runs the
embedding's table slab by slab in training (``tt/tied_logits.py``) and builds it once, cached, in
inference.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import expected
from ..tt.contract import through_bond
from ..tt.tied_logits import tied_logits
from .codebook_embedding import CodebookEmbedding
from .tt_embedding import TTEmbedding

TIEABLE = (TTEmbedding, CodebookEmbedding)  # the compressed embeddings a head can share


class TiedTTHead(nn.Module):
    """An LM head tied to a compressed input embedding: logits through the embedding's own cores (or codebook
    rows), never a second copy of the table."""
    def __init__(self, embedding: TTEmbedding | CodebookEmbedding, bias: nn.Parameter | None = None):
        super().__init__()
        if not isinstance(embedding, TIEABLE):
            raise TypeError(expected("a TTEmbedding or CodebookEmbedding to tie to", type(embedding).__name__))
        # Kept out of the module tree: the embedding is registered where it lives, not twice.
        object.__setattr__(self, "embedding", embedding)
        self.in_features = embedding.embedding_dim
        self.out_features = embedding.num_embeddings
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary for hidden states ``x``."""
        if isinstance(self.embedding, CodebookEmbedding):
            return torch.nn.functional.linear(x, self.embedding.table(), self.bias)
        spec = self.embedding.spec
        if spec.layout == "tt":  # x R^T L^T + b through the cached (in eval) halves of the embedding
            left, right = self.embedding.halves(0)
            # One logit per token id: the left half's rows in id order, without the padding rows.
            return through_bond(x, right.t(), self.embedding.in_token_order(left).t(), self.bias)
        # ttm: the logits are tokens x vocab anyway, and contracting core by core would hold a
        # tokens x rows x rank x cols intermediate many times their size. Training runs the table's
        # rows slab by slab through GEMMs (never holding the table or its gradient); inference
        # builds the table once and keeps it.
        if torch.is_grad_enabled():
            return tied_logits(x, self.embedding.gated_cores(), spec, self.bias, self.embedding.row_of_token)
        table = self.embedding.table()
        return torch.nn.functional.linear(x, table, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The (vocab, dim) weight: the embedding's table."""
        return self.embedding.dense_matrix()

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, built on demand (a copy), for code that reads ``head.weight``."""
        return self.dense_weight()

    def extra_repr(self) -> str:
        """Shapes, layout and ranks, for ``print(model)``."""
        tied_to = type(self.embedding).__name__
        return f"in_features={self.in_features}, out_features={self.out_features}, tied to {tied_to}"
