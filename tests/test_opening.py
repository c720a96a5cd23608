"""Dense layers opened to the gates (training/opening.py): exact, and only where a target needs them."""

import pytest
import torch

from comera_convert.layers import TTLinear
from comera_convert.training.opening import dense_block_linears, fold_oversized, open_dense_layers, stored_params

from .tiny_models import build, outputs


@pytest.mark.parametrize("case", ["bert-mlm", "gpt2-clm", "llama-clm"])
def test_opened_layers_are_gated_full_rank_pairs_that_compute_what_the_dense_ones_did(case):
    model = build(case)
    before = outputs(model)
    names = dense_block_linears(model)
    dense = {name: model.get_submodule(name) for name in names}
    assert names and all(".0." in n or ".1." in n for n in names)  # the blocks' linears, not the head
    added = open_dense_layers(model, names)
    for name, layer in dense.items():
        opened = model.get_submodule(name)
        weight = layer.weight if isinstance(layer, torch.nn.Linear) else layer.weight.t()
        assert isinstance(opened, TTLinear) and opened.gates is not None
        assert opened.ranks == (min(weight.shape),)
        torch.testing.assert_close(opened.dense_weight(), weight, atol=1e-5, rtol=1e-4)
    assert added == sum(stored_params(model.get_submodule(n)) - stored_params(d) for n, d in dense.items()) > 0
    torch.testing.assert_close(outputs(model), before, atol=1e-4, rtol=1e-4)
    assert dense_block_linears(model) == []


def test_a_model_without_a_stack_of_blocks_has_nothing_to_open():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert dense_block_linears(model) == []


@pytest.mark.parametrize("case", ["bert-mlm", "gpt2-clm"])
def test_pairs_that_hold_more_than_their_matrix_are_folded_back_to_the_dense_class(case):
    model = build(case)
    names = dense_block_linears(model)
    classes = {name: type(model.get_submodule(name)) for name in names}
    open_dense_layers(model, names)
    small, large = names[0], names[1]
    pair = model.get_submodule(small)
    with torch.no_grad():
        pair.gates[0][8:] = 0  # 8 of 64 directions left: far below the matrix's size
    pair.cut_to_open_ranks_()
    before = outputs(model)
    products = {name: model.get_submodule(name).dense_weight() for name in names}
    folded = fold_oversized(model, names)
    assert small not in folded and large in folded and len(folded) == len(names) - 1
    assert isinstance(model.get_submodule(small), TTLinear)
    for name in folded:
        dense = model.get_submodule(name)
        assert type(dense) is classes[name]  # nn.Linear, or GPT-2's Conv1D
        weight = dense.weight if isinstance(dense, torch.nn.Linear) else dense.weight.t()
        torch.testing.assert_close(weight, products[name])
    torch.testing.assert_close(outputs(model), before, atol=1e-4, rtol=1e-4)
    assert fold_oversized(model, names) == []  # nothing left to fold
    assert stored_params(model.get_submodule(small)) < stored_params(model.get_submodule(large))
