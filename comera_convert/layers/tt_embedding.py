"""TTEmbedding: a drop-in for nn.Embedding whose table is a TT matrix (tt layout by default, as the
converter's; CoMERA's ttm with ``layout="ttm"``)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import expected
from ..tt import matrix_to_cores
from ..tt.contract import embedding_halves, rows_from_halves
from ..tt.counting import embedding_lookup_flops, ttm_split
from ..tt.spec import TTSpec
from .base import TTModule, check_size, check_token_ids, checked_padding_idx, embedding_repr, padding_rows_frozen
from .tt_linear import DEFAULT_ORDER, DEFAULT_RANK


class TTEmbedding(TTModule):
    """Looks up rows of a (num_embeddings x embedding_dim) table held as TT cores.

    A lookup computes only the requested rows: both half-products of the cores are built once per
    call and each row is a gathered slice of one times a slice of the other (as CoMERA does).
    ``padding_idx`` behaves as in nn.Embedding: its row gets no gradient.

    ``reordered``: the TT rows hold the tokens in another order than their ids (data-aware
    conversion puts the most frequent tokens first, so that the leading mode's slices, and with
    them the truncated bonds, serve them); the buffer ``row_of_token`` maps each id to its row.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 rank=DEFAULT_RANK, layout: str = "tt", d: int = DEFAULT_ORDER,
                 row_modes=None, col_modes=None, gates: bool = True, reordered: bool = False,
                 device=None, dtype=None):
        super().__init__()
        check_size("num_embeddings", num_embeddings)
        check_size("embedding_dim", embedding_dim)
        padding_idx = checked_padding_idx(padding_idx, num_embeddings)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        spec = TTSpec.plan(num_embeddings, embedding_dim, rank, layout=layout, d=d,
                           row_modes=row_modes, col_modes=col_modes)
        self._init_factors(spec, gates, device=device, dtype=dtype)
        # int32: 4 bytes per token in the checkpoint (0.5 % of a rank-100 TT table of BERT's vocabulary).
        identity = torch.arange(num_embeddings, dtype=torch.int32, device=device)
        self.register_buffer("row_of_token", identity if reordered else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random cores, scaled so that the product has the variance of the dense layer's initialization."""
        self._random_init(target_std=1.0)  # nn.Embedding draws its table from N(0, 1)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, rank=DEFAULT_RANK, layout: str = "tt",
                       row_modes=None, col_modes=None, d: int = DEFAULT_ORDER, gates: bool = True,
                       decompose=matrix_to_cores, token_order: torch.Tensor | None = None) -> "TTEmbedding":
        """A TTEmbedding initialized from a dense table by TTM-SVD (or TT-SVD), same device and dtype.

        token_order: the token ids in the order the TT rows should hold them (a permutation, e.g.
        by descending frequency); ``decompose`` then receives the table's rows in that order.
        """
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(expected("an nn.Embedding", type(embedding).__name__))
        weight = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                    rank=rank, layout=layout, d=d, row_modes=row_modes, col_modes=col_modes,
                    gates=gates, reordered=token_order is not None, device=weight.device, dtype=weight.dtype)
        table = weight.detach()
        if token_order is not None:
            token_order = _check_permutation(token_order, embedding.num_embeddings).to(weight.device)
            layer.row_of_token[token_order] = torch.arange(len(token_order), dtype=torch.int32, device=weight.device)
            table = table[token_order]
        layer._load_cores(decompose(table, layer.spec))
        return layer

    @property
    def weight(self) -> torch.Tensor:
        """The dense table, built on demand (for code that reads ``embedding.weight``)."""
        return self.dense_matrix()

    def dense_matrix(self) -> torch.Tensor:
        """The (num_embeddings x embedding_dim) table, rows in token-id order."""
        return self.in_token_order(super().dense_matrix())

    def in_token_order(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows indexed by TT row (padding included) -> rows indexed by token id."""
        if self.row_of_token is None:
            return rows[: self.num_embeddings]
        return rows.index_select(0, self.row_of_token)

    def halves(self, split: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's two halves split after ``split`` row modes (``embedding_halves``), built once
        per weight state in inference (``cached``); a tied head reads them too."""
        return self.cached(f"halves-{split}", lambda: embedding_halves(self.gated_cores(), self.spec, split))

    def table(self) -> torch.Tensor:
        """The whole (rows x dim) table, built once per weight state in inference."""
        return self.cached("table", self.dense_matrix)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """The rows of ``indices``, contracted from the cores (only the rows requested)."""
        # On CUDA (and under torch.compile) no host syncs: a device-side range check, and no
        # deduplication of repeated ids (its output size depends on the data).
        sync_free = check_token_ids(indices, self.num_embeddings)
        spec = self.spec
        split = 0
        if spec.layout == "ttm":
            split = ttm_split(spec, indices.numel(), cost=embedding_lookup_flops)
        halves = self.halves(split)
        tt_rows = indices if self.row_of_token is None else self.row_of_token[indices]
        rows = rows_from_halves(tt_rows.long(), halves, spec, deduplicate=not sync_free)
        return padding_rows_frozen(rows, indices, self.padding_idx, self.training)

    def extra_repr(self) -> str:
        """Shapes, layout and ranks, for ``print(model)``."""
        order = ", reordered" if self.row_of_token is not None else ""
        return f"{embedding_repr(self.num_embeddings, self.embedding_dim, self.padding_idx)}, {self._tt_repr()}{order}"


def _check_permutation(order: torch.Tensor, size: int) -> torch.Tensor:
    order = torch.as_tensor(order)
    is_permutation = (tuple(order.shape) == (size,) and not order.is_floating_point()
                      and bool((order.sort().values.cpu() == torch.arange(size)).all()))
    if not is_permutation:
        raise ValueError(expected(f"token_order as a permutation of the {size} token ids",
                                  f"a tensor of shape {tuple(order.shape)} and dtype {order.dtype}"))
    return order.long()
