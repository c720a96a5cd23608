"""Dense layers opened to the gates, so a mild conversion can compress further while it trains.

A conversion keeps a layer dense where its factorization at the shared rank would not be smaller
(a mild ratio's rank on a square attention projection can cost more than the matrix). The gates
cannot shrink such a layer, so a target ratio can lie beyond what they reach even with every bond at
rank 1 (docs/findings.md). Opened, each dense linear of the block stack becomes a gated low-rank
pair at full rank: the SVD's two factors, exact to rounding, so the model
computes what it did, at twice the parameters of a square layer until the budget closes half of its
directions. The budget then weighs its directions against every other layer's. One that ends the
run above half its rank is saved dense again (``fold_oversized``): the pair would hold more than the
matrix.
"""

from __future__ import annotations

from torch import nn

from ..conversion.targets import find_blocks
from ..hf.loading import dense_linear
from ..layers import PrunedLinear
from ..layers.swap import set_submodule
from ..layers.tt_linear import TTLinear, is_dense_linear
from ..tt.counting import dense_params

# One mode per side: the low-rank pair, the one layout exact at full rank with two factors.
OPENED_MODES = 1


def dense_block_linears(model: nn.Module) -> list[str]:
    """Names of the dense linears (nn.Linear, Conv1D) inside the model's stack of repeated blocks (a
    pruned pair's layers are not: their hidden width is gated by neuron, ``neuron_gates.py``)."""
    blocks = find_blocks(model)
    if blocks is None:
        return []
    return [name for name, module in model.named_modules()
            if name.startswith(blocks + ".") and is_dense_linear(module) and not isinstance(module, PrunedLinear)]


def stored_params(module: nn.Module) -> int:
    """Parameters a module stores (a pair's gates included)."""
    return sum(p.numel() for p in module.parameters())


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
        added += stored_params(opened) - stored_params(dense)
        set_submodule(model, name, opened)
    return added


def fold_oversized(model: nn.Module, names: list[str]) -> list[str]:
    """Each named low-rank pair that stores at least as many parameters as the matrix it represents,
    made the dense layer again (in place); returns their names."""
    folded = []
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, TTLinear):
            continue
        matrix = dense_params(module.spec) + (0 if module.bias is None else module.out_features)
        if stored_params(module) >= matrix:  # counted, not built: a dense weight only for a layer that folds
            set_submodule(model, name, dense_linear(module))
            folded.append(name)
    return folded
