"""The pure contraction functions against the dense matrix they stand for."""

import pytest
import torch

from comera_convert.tt import TTSpec, cores_to_matrix, embedding_rows, tt_linear, ttm_linear
from comera_convert.tt.contract import embedding_halves, rows_from_halves, through_bond
from comera_convert.tt.counting import ttm_split

from .conftest import rel_err


def random_cores(spec, dtype=torch.float64):
    return [torch.randn(shape, dtype=dtype) for shape in spec.core_shapes()]


def test_tt_linear_is_x_times_the_matrix_plus_bias():
    spec = TTSpec.plan(60, 40, 5, layout="tt", d=2)
    cores, bias = random_cores(spec), torch.randn(40, dtype=torch.float64)
    x = torch.randn(2, 3, 60, dtype=torch.float64)
    assert rel_err(tt_linear(x, cores, spec, bias), x @ cores_to_matrix(cores, spec) + bias) < 1e-12


@pytest.mark.parametrize("tokens", [1, 64])
def test_ttm_linear_at_every_split(tokens):
    spec = TTSpec.plan(96, 80, 4, layout="ttm", d=3)
    cores = random_cores(spec)
    x = torch.randn(tokens, 96, dtype=torch.float64)
    for h in (1, 2):
        assert rel_err(ttm_linear(x, cores, spec, h), x @ cores_to_matrix(cores, spec)) < 1e-12
    assert ttm_split(spec, tokens) in (1, 2)


@pytest.mark.parametrize("layout", ["tt", "ttm"])
def test_embedding_rows_are_rows_of_the_matrix(layout):
    spec = TTSpec.plan(1000, 24, 4, layout=layout, d=3)
    cores = random_cores(spec)
    indices = torch.tensor([[0, 999, 17], [17, 500, 3]])
    table = cores_to_matrix(cores, spec)
    for h in (1, 2):
        assert rel_err(embedding_rows(indices, cores, spec, h), table[indices]) < 1e-12


@pytest.mark.parametrize("layout", ["tt", "ttm"])
def test_rows_without_deduplication_are_the_same_rows(layout):
    """The sync-free path (CUDA, torch.compile) gathers every id, repeats included."""
    spec = TTSpec.plan(1000, 24, 4, layout=layout, d=3)
    cores = random_cores(spec)
    indices = torch.tensor([[5, 999, 5], [0, 5, 999]])
    halves = embedding_halves(cores, spec, 1)
    table = cores_to_matrix(cores, spec)
    assert rel_err(rows_from_halves(indices, halves, spec, deduplicate=False), table[indices]) < 1e-12


def test_through_bond_without_autograd_matches_the_autograd_function():
    left, right, bias = torch.randn(60, 5), torch.randn(5, 40), torch.randn(40)
    x = torch.randn(2, 3, 60)
    with_graph = through_bond(x, left.requires_grad_(), right, bias)
    with torch.no_grad():
        torch.testing.assert_close(through_bond(x, left, right, bias), with_graph.detach())
