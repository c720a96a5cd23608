"""The tied head's slab-by-slab logits against a GEMM with the embedding's dense table."""

import pytest
import torch

from comera_convert.layers import TiedTTHead, TTEmbedding
from comera_convert.tt.tied_logits import tied_logits


def leaves(embedding, *others):
    return list(embedding.cores) + list(embedding.gates) + list(others)


def rel_err(got, want):
    return float((got - want).detach().norm() / want.detach().norm())


def gradients(tensors):
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


@pytest.mark.parametrize("reordered", [False, True])
@pytest.mark.parametrize("slab_rows", [1, 40, 10 ** 9])  # a slab per group, several, the whole table
@pytest.mark.parametrize("tokens", [(2, 5), (4, 16)])  # fewer tokens than columns (slabs rebuilt), more (kept)
# A prime vocabulary and a dimension that is no product of the column modes (rows and columns
# padded), and sizes that factor exactly (no padding anywhere).
@pytest.mark.parametrize("vocab,dim,padded", [(1009, 50, True), (1000, 48, False)])
def test_logits_and_every_gradient_match_the_dense_table(reordered, slab_rows, tokens, vocab, dim, padded):
    torch.manual_seed(0)
    embedding = TTEmbedding(vocab, dim, rank=6, reordered=reordered, layout="ttm")
    if reordered:
        embedding.row_of_token.copy_(torch.randperm(vocab).int())
    spec = embedding.spec
    assert (spec.padded_rows > vocab and spec.padded_cols > dim) == padded
    assert padded or (spec.padded_rows, spec.padded_cols) == (vocab, dim)
    bias = torch.randn(vocab, requires_grad=True)
    x = torch.randn(*tokens, dim, requires_grad=True)
    upstream = torch.randn(*tokens, vocab)
    tensors = leaves(embedding, x, bias)

    expected = torch.nn.functional.linear(x, embedding.dense_matrix(), bias)
    expected.backward(upstream)
    expected_grads = gradients(tensors)
    logits = tied_logits(x, embedding.gated_cores(), spec, bias, embedding.row_of_token, slab_rows=slab_rows)
    logits.backward(upstream)

    assert logits.shape == (*tokens, vocab)
    assert rel_err(logits, expected) < 1e-5
    errors = [rel_err(got, want) for got, want in zip(gradients(tensors), expected_grads)]
    assert max(errors) < 1e-5, errors


def test_the_tied_head_trains_through_slabs_and_infers_from_the_cached_table():
    torch.manual_seed(0)
    embedding = TTEmbedding(500, 24, rank=5, layout="ttm")
    head = TiedTTHead(embedding, bias=torch.nn.Parameter(torch.randn(500)))
    x = torch.randn(3, 24)
    training = head(x)
    assert "TiedLogits" in type(training.grad_fn.next_functions[0][0]).__name__
    assert "table" not in embedding.__dict__.get("_inference_cache", {})
    embedding.eval()  # in a model, model.eval() sets it
    with torch.no_grad():
        inference = head(x)
    assert "table" in embedding.__dict__["_inference_cache"]
    assert rel_err(inference, training.detach()) < 1e-5


def test_under_bf16_autocast_it_runs_as_the_dense_linear_would():
    """Autocast runs F.linear in bf16; the slabs run in bf16 too, and gradients come back in fp32."""
    torch.manual_seed(0)
    embedding = TTEmbedding(1009, 50, rank=6, layout="ttm")
    bias = torch.randn(1009, requires_grad=True)
    x = torch.randn(8, 50, requires_grad=True)
    tensors = leaves(embedding, x, bias)
    results = []
    for run in ("dense", "slabs"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if run == "dense":
                logits = torch.nn.functional.linear(x, embedding.dense_matrix(), bias)
            else:
                logits = tied_logits(x, embedding.gated_cores(), embedding.spec, bias, slab_rows=40)
        logits.float().square().mean().backward()
        results.append((logits, gradients(tensors)))
    (dense, dense_grads), (slabs, slab_grads) = results
    assert slabs.dtype == dense.dtype == torch.bfloat16
    assert rel_err(slabs.float(), dense.float()) < 1e-2
    assert all(g.dtype == torch.float32 for g in slab_grads)
    errors = [rel_err(got, want) for got, want in zip(slab_grads, dense_grads)]
    assert max(errors) < 5e-2, errors


def test_a_tt_layout_spec_is_refused():
    embedding = TTEmbedding(100, 16, rank=4, layout="tt")
    with pytest.raises(ValueError, match="expected a ttm-layout spec, got 'tt'"):
        tied_logits(torch.randn(2, 16), embedding.gated_cores(), embedding.spec)
