import pytest
import torch
from torch import nn

from comera_convert import TTEmbedding
from comera_convert.tt import cores_to_matrix

from .conftest import rel_err, tolerance

FULL = 10 ** 6


@pytest.mark.parametrize("layout", ["tt", "ttm"])
@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_full_rank_lookup_equals_the_dense_table(layout, d, dtype):
    dense = nn.Embedding(500, 48, dtype=dtype)  # 500 = 2^2 * 5^3: modes need no padding for d <= 3
    tt = TTEmbedding.from_embedding(dense, rank=FULL, layout=layout, d=d)
    idx = torch.randint(0, 500, (4, 9))
    assert tt(idx).dtype == dtype
    assert rel_err(tt(idx), dense(idx)) < tolerance(dtype)


def test_badly_factoring_vocab_is_padded_and_sliced():
    dense = nn.Embedding(30522 // 30, 24)  # 1017 = 3^2 * 113
    tt = TTEmbedding.from_embedding(dense, rank=FULL, layout="ttm")
    assert tt.spec.padded_rows > 1017
    idx = torch.tensor([0, 1, 500, 1016])
    assert rel_err(tt(idx), dense(idx)) < 1e-4


def test_lookup_computes_only_the_requested_rows():
    """Lookups for a few tokens must not cost as much as building the table."""
    from torch.utils.flop_counter import FlopCounterMode

    tt = TTEmbedding(30522, 768, rank=30, layout="ttm")
    idx = torch.randint(0, 30522, (2, 16))
    with FlopCounterMode(display=False) as counter:
        tt(idx)
    table_flops = 2 * 30522 * 768 * 30  # the last contraction alone, if the table were built
    assert counter.get_total_flops() < table_flops / 10


def test_repeated_indices_give_the_same_rows():
    tt = TTEmbedding(100, 16, rank=4, layout="ttm")
    out = tt(torch.tensor([[3, 7, 3], [7, 7, 3]]))
    assert torch.equal(out[0, 0], out[0, 2]) and torch.equal(out[0, 1], out[1, 0])


def test_padding_idx_gets_no_gradient_but_keeps_its_row():
    dense = nn.Embedding(64, 16, padding_idx=0)
    with torch.no_grad():
        dense.weight[0] = 1.0  # a pretrained padding row need not be zero
    tt = TTEmbedding.from_embedding(dense, rank=FULL, d=2, layout="ttm")
    idx = torch.tensor([[0, 5, 0]])
    assert rel_err(tt(idx), dense(idx)) < 1e-4
    tt(torch.tensor([[0, 0]])).sum().backward()
    assert all(c.grad is None or torch.count_nonzero(c.grad) == 0 for c in tt.cores)
    tt.zero_grad()
    tt(idx).sum().backward()
    assert any(torch.count_nonzero(c.grad) > 0 for c in tt.cores)


def test_negative_padding_idx_is_normalized():
    assert TTEmbedding(50, 8, padding_idx=-1, rank=2, layout="ttm").padding_idx == 49


def test_gradcheck():
    tt = TTEmbedding(24, 12, rank=3, d=2, dtype=torch.float64, layout="ttm")
    names = [n for n, _ in tt.named_parameters()]
    idx = torch.tensor([[1, 5, 5, 23]])

    def fn(*params):
        return torch.func.functional_call(tt, dict(zip(names, params)), (idx,))

    params = tuple(p.detach().clone().requires_grad_(True) for p in tt.parameters())
    assert torch.autograd.gradcheck(fn, params)


def test_weight_property_is_the_dense_table():
    tt = TTEmbedding(40, 8, rank=3, d=2, layout="ttm")
    assert torch.equal(tt.weight, cores_to_matrix(tt.gated_cores(), tt.spec))


def test_prune_keeps_lookups():
    tt = TTEmbedding.from_embedding(nn.Embedding(64, 32), rank=8, d=2, layout="ttm")
    with torch.no_grad():
        tt.gates[0][3:] = 0
    idx = torch.arange(64)
    before = tt(idx)
    assert tt.prune_ranks() == (3,)
    assert rel_err(tt(idx), before) < 1e-5


def test_bad_input():
    with pytest.raises(TypeError, match=r"expected an nn.Embedding \(got 'Linear'\)"):
        TTEmbedding.from_embedding(nn.Linear(4, 4))
    tt = TTEmbedding(40, 8, rank=3, d=2, layout="ttm")
    with pytest.raises(IndexError, match=r"indices in \[0, 40\)"):
        tt(torch.tensor([3, 40]))
    with pytest.raises(TypeError, match="integer token indices"):
        tt(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="padding_idx within"):
        TTEmbedding(40, 8, padding_idx=40)


@pytest.mark.parametrize("layout", ["tt", "ttm"])
def test_reordered_rows_look_up_by_token_id(layout):
    """Frequent-first TT rows: lookups, ``weight`` and the tied head all stay in token-id order."""
    from comera_convert.layers import TiedTTHead

    dense = nn.Embedding(1009, 24)  # a prime vocabulary: the TT rows are padded to 1024
    order = torch.randperm(1009)
    tt = TTEmbedding.from_embedding(dense, rank=FULL, layout=layout, token_order=order)
    idx = torch.tensor([[0, 7, 1008], [order[0], order[1], 3]])
    assert rel_err(tt(idx), dense(idx)) < 1e-4
    assert rel_err(tt.weight, dense.weight) < 1e-4
    assert torch.equal(tt.row_of_token[order], torch.arange(1009, dtype=torch.int32))
    x = torch.randn(3, 24)
    logits = TiedTTHead(tt)(x)
    assert logits.shape == (3, 1009) and rel_err(logits, x @ dense.weight.T) < 1e-4


def test_frequent_tokens_first_are_kept_better_by_weighted_truncation():
    """What data-aware conversion does: weight rows by frequency and put frequent tokens first. The
    weights of frequent-first rows factor over the modes, so the truncation serves those tokens;
    the same weights over scattered ids do not."""
    from functools import partial

    from comera_convert.tt.weighted import whitened_tt_cores

    torch.manual_seed(0)
    dense = nn.Embedding(1000, 32)
    frequent = torch.randperm(1000)[:100]
    weights = torch.ones(1000, dtype=torch.float64)
    weights[frequent] = 30.0
    order = torch.sort(weights, descending=True, stable=True).indices
    scattered = TTEmbedding.from_embedding(dense, rank=12, layout="tt",
                                           decompose=partial(whitened_tt_cores, factor=weights))
    first = TTEmbedding.from_embedding(dense, rank=12, layout="tt", token_order=order,
                                       decompose=partial(whitened_tt_cores, factor=weights[order]))
    errors = {name: rel_err(tt(frequent), dense(frequent)) for name, tt in (("scattered", scattered), ("first", first))}
    assert errors["first"] < 0.8 * errors["scattered"], errors


def test_token_order_must_be_a_permutation():
    dense = nn.Embedding(100, 8)
    for bad in (torch.arange(99), torch.zeros(100, dtype=torch.long), torch.arange(100.0)):
        with pytest.raises(ValueError, match="permutation of the 100 token ids"):
            TTEmbedding.from_embedding(dense, rank=4, token_order=bad, layout="ttm")
