import pytest
import torch

from comera_convert.tt import TTSpec, cores_to_matrix, matrix_to_cores, tt_svd
from comera_convert.tt.decompose import contract_chain, unfolding_tail_bound
from comera_convert.tt.reference import tensorly_matrix_to_cores

from .conftest import rel_err

LAYOUTS = ["tt", "ttm"]
ORDERS = [2, 3, 4]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", ORDERS)
def test_full_rank_round_trip_is_exact(layout, d):
    matrix = torch.randn(96, 80, dtype=torch.float64)
    spec = TTSpec.plan(96, 80, 10 ** 6, layout=layout, d=d)
    assert rel_err(cores_to_matrix(matrix_to_cores(matrix, spec), spec), matrix) < 1e-12


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_shapes_round_trip(layout):
    matrix = torch.randn(37, 29, dtype=torch.float64)  # primes: modes are padded
    spec = TTSpec.plan(37, 29, 10 ** 6, layout=layout, d=2)
    assert spec.padded_rows > 37 and spec.padded_cols > 29
    assert rel_err(cores_to_matrix(matrix_to_cores(matrix, spec), spec), matrix) < 1e-12


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rank", [2, 6, 16])
def test_truncation_error_obeys_the_tt_svd_bound(layout, rank):
    matrix = torch.randn(64, 96, dtype=torch.float64)
    spec = TTSpec.plan(64, 96, rank, layout=layout)
    err = float((cores_to_matrix(matrix_to_cores(matrix, spec), spec) - matrix).norm())
    bound = unfolding_tail_bound(matrix, spec)
    assert err <= bound * (1 + 1e-9)
    # The bound is not loose either: it is within sqrt(#bonds) of the largest single-bond error.
    assert err >= bound / len(spec.ranks) ** 0.5 * 0.99


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", ORDERS)
def test_matches_tensorly_reference(layout, d):
    matrix = torch.randn(96, 64, dtype=torch.float64)
    spec = TTSpec.plan(96, 64, 5, layout=layout, d=d)
    ours = cores_to_matrix(matrix_to_cores(matrix, spec), spec)
    ref = cores_to_matrix(tensorly_matrix_to_cores(matrix, spec), spec)
    assert rel_err(ours, ref) < 1e-8


def test_tensorly_backend_is_left_as_the_user_set_it():
    import tensorly as tl

    before = tl.get_backend()
    spec = TTSpec.plan(16, 16, 3, d=2)
    tensorly_matrix_to_cores(torch.randn(16, 16), spec)
    assert tl.get_backend() == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_weights_decompose_in_float32_and_cast_back(dtype):
    matrix = torch.randn(48, 64).to(dtype)
    spec = TTSpec.plan(48, 64, 10 ** 6)
    cores = matrix_to_cores(matrix, spec)
    assert all(c.dtype == dtype for c in cores)
    reference = cores_to_matrix(matrix_to_cores(matrix.float(), spec), spec)
    assert rel_err(cores_to_matrix([c.float() for c in cores], spec), reference) < 2e-2


def test_rank_deficient_matrix_gets_zero_padded_cores_of_the_planned_shape():
    matrix = torch.randn(64, 2) @ torch.randn(2, 64)  # rank 2
    spec = TTSpec.plan(64, 64, 16, layout="tt", d=2)
    cores = matrix_to_cores(matrix, spec)
    assert [tuple(c.shape) for c in cores] == spec.core_shapes()
    assert rel_err(cores_to_matrix(cores, spec), matrix) < 1e-5


def test_tt_svd_of_a_plain_tensor():
    tensor = torch.randn(4, 5, 6, dtype=torch.float64)
    cores = tt_svd(tensor, (4, 6))
    assert rel_err(contract_chain(cores), tensor) < 1e-12


def test_wrong_matrix_shape_is_refused():
    spec = TTSpec.plan(64, 64, 4)
    with pytest.raises(ValueError, match=r"expected a 64 x 64 matrix \(got \(64, 32\)\)"):
        matrix_to_cores(torch.randn(64, 32), spec)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float32_truncation_is_as_good_as_tensorly(layout):
    # A matrix with a decaying spectrum, like a pretrained weight.
    u, _ = torch.linalg.qr(torch.randn(384, 384))
    v, _ = torch.linalg.qr(torch.randn(1536, 384))
    matrix = (u * torch.logspace(0, -3, 384)) @ v.T
    spec = TTSpec.plan(384, 1536, 24, layout=layout)
    ours = float((cores_to_matrix(matrix_to_cores(matrix, spec), spec) - matrix).norm())
    ref = float((cores_to_matrix(tensorly_matrix_to_cores(matrix, spec), spec) - matrix).norm())
    assert ours <= ref * 1.001


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_gram_matrix_lower_triangle_is_the_product_in_every_memory_layout(dtype):
    from comera_convert.tt.decompose import gram

    matrix = torch.randn(40, 90, dtype=dtype, generator=torch.Generator().manual_seed(0))
    for layout in (matrix, matrix.T.contiguous().T, matrix[:, ::3], matrix.T):  # C, Fortran, strided, tall
        expected = layout.double() @ layout.double().T
        product = gram(layout)
        assert product.shape == expected.shape
        assert torch.allclose(torch.tril(product).double(), torch.tril(expected), rtol=1e-5, atol=1e-4)


def test_top_eigenvectors_span_the_leading_eigenspace_by_the_subset_and_the_full_solver():
    from comera_convert.tt.decompose import gram, top_eigenvectors

    matrix = torch.randn(60, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference = torch.linalg.svd(matrix, full_matrices=False).U
    for count in (5, 40):  # below and above the share where the subset solver is used
        vectors = top_eigenvectors(gram(matrix), count)
        projector = vectors @ vectors.T
        assert torch.allclose(projector, reference[:, :count] @ reference[:, :count].T, atol=1e-8)
