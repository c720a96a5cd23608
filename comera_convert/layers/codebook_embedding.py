"""CodebookEmbedding: a drop-in for nn.Embedding whose table is product-quantized (codebook/).

Each row is cut into slices; each slice is one of a few shared centres (a trainable codebook per
slice), the row stored as one byte per slice. A lookup gathers the rows' codes and their centres:
no product of factors, no dense table. Training moves the centres (every row that uses one moves
with it); the codes stay as the k-means fit chose them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..codebook import CodebookSpec, dense_from_codes, product_quantize
from ..errors import expected
from ..integer import fake_quantize
from .base import (InferenceCache, check_size, check_token_ids, checked_padding_idx, embedding_repr,
                   padding_rows_frozen)

# Lloyd steps of the fit: more gain little (docs/findings.md).
FIT_ITERATIONS = 10
# The centres are fit on this many random rows, then every row is coded: a third of the time of a fit
# on all of a 30,522-row table, at nearly its error (docs/findings.md).
FIT_ROWS = 8192


class CodebookEmbedding(InferenceCache):
    """Looks up rows of a (num_embeddings x embedding_dim) table held as codes into per-slice codebooks.

    ``padding_idx`` behaves as in nn.Embedding: its row gets no gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 subspaces: int, codewords: int = 256, device=None, dtype=None):
        super().__init__()
        check_size("num_embeddings", num_embeddings)
        check_size("embedding_dim", embedding_dim)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = checked_padding_idx(padding_idx, num_embeddings)
        dtype = dtype or torch.get_default_dtype()
        self._spec = CodebookSpec(num_embeddings, embedding_dim, subspaces, codewords,
                                  torch.empty((), dtype=dtype).element_size())
        self.codebooks = nn.Parameter(torch.empty(subspaces, codewords, self._spec.width, device=device, dtype=dtype))
        self.register_buffer("codes", torch.zeros(num_embeddings, subspaces, dtype=torch.uint8, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random centres (nn.Embedding draws its table from N(0, 1)) and random codes."""
        with torch.no_grad():
            self.codebooks.normal_()
            self.codes.copy_(torch.randint(self._spec.codewords, self.codes.shape, dtype=torch.uint8))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, subspaces: int, codewords: int = 256,
                       weights: torch.Tensor | None = None, iterations: int = FIT_ITERATIONS,
                       sample: int | None = FIT_ROWS, device=None) -> "CodebookEmbedding":
        """A CodebookEmbedding fit to a dense table by k-means per slice, on the table's device and
        dtype (the fit itself on ``device`` when given). ``weights``: each row's pull on the centres;
        ``sample``: the centres fit on that many random rows (None: all), every row coded."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(expected("an nn.Embedding", type(embedding).__name__))
        weight = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                    subspaces=subspaces, codewords=codewords, device=weight.device, dtype=weight.dtype)
        table = weight.detach() if device is None else weight.detach().to(device)
        codebooks, codes = product_quantize(table, subspaces, codewords, iterations,
                                            None if weights is None else weights.to(table.device), sample=sample)
        with torch.no_grad():
            layer.codebooks.copy_(codebooks)
            layer.codes.copy_(codes)
        return layer

    @property
    def spec(self) -> CodebookSpec:
        return self._spec

    @property
    def weight(self) -> torch.Tensor:
        """The dense table, built on demand (for code that reads ``embedding.weight``)."""
        return self.dense_matrix()

    # The integer format the checkpoint stores the centres in (None: float); set, lookups use the
    # centres rounded to it (quantization-aware training, as TTModule.integer_format).
    integer_format = None

    def centres(self) -> torch.Tensor:
        """The codebooks, rounded to ``integer_format`` when set (a scale per slice)."""
        if self.integer_format is None:
            return self.codebooks
        return fake_quantize(self.codebooks, self.integer_format, 0)

    def dense_matrix(self) -> torch.Tensor:
        """The (num_embeddings x embedding_dim) table the codes name."""
        return dense_from_codes(self.centres(), self.codes)

    def table(self) -> torch.Tensor:
        """The whole table, built once per state of the centres and codes in inference (a tied
        head multiplies by it: GPT-2's 50,257 rows each generated token otherwise)."""
        return self.cached("table", self.dense_matrix)

    def _stamped_tensors(self) -> list[torch.Tensor]:
        return [self.codebooks, self.codes]

    def stored_params(self) -> int:
        """The codebooks' parameters plus the codes counted in units of a parameter (one byte per
        row and slice: four codes cost one float32)."""
        return self.codebooks.numel() + math.ceil(self.codes.numel() / self.codebooks.element_size())

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """The rows of ``indices``: each slice's code looked up in its codebook."""
        check_token_ids(indices, self.num_embeddings)
        rows = dense_from_codes(self.centres(), self.codes[indices])
        return padding_rows_frozen(rows, indices, self.padding_idx, self.training)

    def extra_repr(self) -> str:
        """Shapes, layout and ranks, for ``print(model)``."""
        return (f"{embedding_repr(self.num_embeddings, self.embedding_dim, self.padding_idx)}, "
                f"subspaces={self._spec.subspaces}, codewords={self._spec.codewords}")
