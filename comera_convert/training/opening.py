"""Dense layers opened to the gates, so a mild conversion can compress further while it trains.

A conversion keeps a layer dense where its factorization at the shared rank would not be smaller
(MiniLM at ``--ratio 2``: rank 282 of a 384 x 384 attention projection costs more than the matrix).
The gates cannot shrink such a layer, so a target ratio can lie beyond what they reach (MiniLM
``--ratio 2`` stops at 3.82x with every bond at rank 1). Opened, each dense linear of the block stack
becomes a gated low-rank pair at full rank: the SVD's two factors, exact to rounding, so the model
computes what it did, at twice the parameters of a square layer until the budget closes half of its
directions. The budget then weighs its directions against every other layer's.
"""

from __future__ import annotations

from torch import nn

from ..conversion.targets import find_blocks
from ..layers.swap import set_submodule
from ..layers.tt_linear import TTLinear, is_dense_linear

# One mode per side: the low-rank pair, the one layout exact at full rank with two factors.
OPENED_MODES = 1


def dense_block_linears(model: nn.Module) -> list[str]:
    """Names of the dense linears (nn.Linear, Conv1D) inside the model's stack of repeated blocks."""
    blocks = find_blocks(model)
    if blocks is None:
        return []
    return [name for name, module in model.named_modules()
            if name.startswith(blocks + ".") and is_dense_linear(module)]


def full_rank(module: nn.Module) -> int:
    """The rank at which a low-rank pair represents ``module``'s weight exactly."""
    return min(module.weight.shape)


def open_dense_layers(model: nn.Module, names: list[str]) -> int:
    """Replace each named dense linear by a gated low-rank pair of the same product (on its device, in
    its dtype); returns the parameters this adds."""
    added = 0
    for name in names:
        dense = model.get_submodule(name)
        opened = TTLinear.from_linear(dense, rank=full_rank(dense), d=OPENED_MODES, gates=True)
        added += sum(p.numel() for p in opened.parameters()) - sum(p.numel() for p in dense.parameters())
        set_submodule(model, name, opened)
    return added
