import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from comera_convert import TTLinear
from comera_convert.tt import linear_forward_flops, num_params
from comera_convert.tt.decompose import unfolding_tail_bound

from .conftest import rel_err, tolerance

LAYOUTS = ["tt", "ttm"]
ORDERS = [2, 3, 4]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
FULL = 10 ** 6  # clipped down to the largest ranks the shape allows


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_rank_reproduces_the_dense_layer(layout, d, dtype):
    dense = nn.Linear(96, 64, dtype=dtype)
    tt = TTLinear.from_linear(dense, rank=FULL, layout=layout, d=d)
    assert all(p.dtype == dtype for p in tt.parameters())
    x = torch.randn(3, 5, 96, dtype=dtype)
    assert rel_err(tt(x), dense(x)) < tolerance(dtype)
    assert rel_err(tt.dense_weight(), dense.weight) < tolerance(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rank", [3, 8])
def test_low_rank_error_matches_the_truncated_svd_bound(layout, rank):
    dense = nn.Linear(64, 96, dtype=torch.float64)
    tt = TTLinear.from_linear(dense, rank=rank, layout=layout)
    err = float((tt.dense_weight() - dense.weight).detach().norm())
    assert err <= unfolding_tail_bound(dense.weight.t(), tt.spec) * (1 + 1e-9)
    assert err > 0


def test_transformers_conv1d_is_a_transposed_linear():
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(nf=48, nx=32)
    nn.init.normal_(conv.weight)
    tt = TTLinear.from_linear(conv, rank=FULL, d=2)
    x = torch.randn(4, 32)
    assert (tt.in_features, tt.out_features) == (32, 48)
    assert rel_err(tt(x), conv(x)) < 1e-4


def test_no_bias_and_custom_modes():
    dense = nn.Linear(60, 48, bias=False)
    tt = TTLinear.from_linear(dense, rank=FULL, in_modes=(5, 4, 3), out_modes=(4, 4, 3))
    assert tt.bias is None
    assert tt.spec.row_modes == (5, 4, 3) and tt.spec.col_modes == (4, 4, 3)
    x = torch.randn(7, 60)
    assert rel_err(tt(x), dense(x)) < 1e-4


def test_device_and_dtype_follow_the_source_layer():
    dense = nn.Linear(32, 32, dtype=torch.float64)
    tt = TTLinear.from_linear(dense, rank=4)
    assert {p.dtype for p in tt.parameters()} == {torch.float64}
    assert {p.device for p in tt.parameters()} == {dense.weight.device}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck(layout):
    tt = TTLinear(12, 8, rank=3, layout=layout, d=2, dtype=torch.float64)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    params = tuple(tt.parameters())

    def fn(x, *params_in):
        mapping = dict(zip((n for n, _ in tt.named_parameters()), params_in))
        return torch.func.functional_call(tt, mapping, (x,))

    inputs = (x,) + tuple(p.detach().clone().requires_grad_(True) for p in params)
    assert torch.autograd.gradcheck(fn, inputs)


def test_tt_forward_never_builds_the_dense_weight():
    tt = TTLinear(768, 3072, rank=30)
    x = torch.randn(256, 768)
    with FlopCounterMode(display=False) as counter:
        tt(x)
    counted = counter.get_total_flops()
    assert counted == linear_forward_flops(tt.spec, 256)
    assert counted < 2 * 256 * 768 * 3072 / 5  # the dense GEMM would cost at least 5x more


def test_ttm_flop_model_matches_what_runs():
    tt = TTLinear(768, 768, rank=16, layout="ttm")
    x = torch.randn(64, 768)
    with FlopCounterMode(display=False) as counter:
        tt(x)
    assert counter.get_total_flops() == linear_forward_flops(tt.spec, 64)


def test_random_init_has_linear_like_output_scale():
    tt = TTLinear(512, 512, rank=16)
    dense = nn.Linear(512, 512)
    x = torch.randn(1024, 512)
    ratio = float((tt(x).std() / dense(x).std()).detach())
    assert 0.5 < ratio < 2.0


def test_gates_start_open_and_prune_shrinks_the_layer():
    dense = nn.Linear(64, 64)
    tt = TTLinear.from_linear(dense, rank=8, d=2)
    assert tt.ranks == tt.bond_dims == (8, 8, 8)
    x = torch.randn(5, 64)
    with torch.no_grad():
        tt.gates[1][4:] = 0.0           # switch half of the middle bond off
        tt.gates[0].mul_(0.5)           # and scale another bond
    before = tt(x)
    assert tt.ranks == (8, 4, 8) and tt.bond_dims == (8, 8, 8)
    params_before = num_params(tt.spec)
    assert tt.prune_ranks() == (8, 4, 8)
    assert num_params(tt.spec) < params_before
    assert [tuple(c.shape) for c in tt.cores] == tt.spec.core_shapes()
    assert all(torch.equal(g, torch.ones_like(g)) for g in tt.gates)  # values folded into cores
    assert rel_err(tt(x), before) < 1e-5
    assert len(tt.state_dict()["cores.1"].reshape(-1)) == tt.cores[1].numel()


def test_prune_threshold_and_fully_closed_bond():
    tt = TTLinear(32, 32, rank=4, d=2)
    with torch.no_grad():
        tt.gates[1].copy_(torch.tensor([1e-3, 0.5, 1e-4, 2.0]))
        tt.gates[0].zero_()
    tt.prune_ranks(threshold=1e-2)
    assert tt.bond_dims == (1, 2, 4)  # a closed bond keeps its strongest index, never size 0


def test_gates_are_optional():
    tt = TTLinear(32, 32, rank=4, gates=False)
    assert tt.gates is None and not tt.gated
    assert tt.prune_ranks() == tt.bond_dims
    assert not any("gate" in name for name, _ in tt.named_parameters())


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(rank=0), ValueError, r"rank >= 1 \(got 0\)"),
    (dict(in_modes=(8, 8, 8)), ValueError, "multiply to 512, expected at least 768"),
    (dict(layout="blocktt"), ValueError, "layout in"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        TTLinear.from_linear(nn.Linear(768, 768), **kwargs)


def test_non_linear_is_refused():
    with pytest.raises(TypeError, match=r"expected an nn.Linear or transformers Conv1D \(got 'Embedding'\)"):
        TTLinear.from_linear(nn.Embedding(10, 10))


def test_wrong_input_width_is_refused():
    with pytest.raises(ValueError, match=r"last dimension 32"):
        TTLinear(32, 16, rank=4)(torch.randn(2, 31))


def test_inference_reuses_merged_halves_until_the_cores_change():
    tt = TTLinear(64, 48, rank=4, d=2)
    x = torch.randn(3, 64)
    with torch.no_grad():
        tt(x)
        assert "_inference_cache" not in tt.__dict__  # train mode never caches
        tt.eval()
        first = tt(x)
        assert len(tt._inference_cache) == 1
        assert torch.equal(tt(x), first)
        tt.cores[0].mul_(2.0)  # an optimizer step or a load changes the cores in place
        changed = tt(x)
    assert not torch.equal(changed, first)
    assert rel_err(changed, x @ tt.dense_weight().t() + tt.bias) < 1e-5


@pytest.mark.parametrize("gates", [True, False])
def test_inference_after_a_fused_optimizer_step_sees_the_new_cores(gates):
    tt = TTLinear(64, 48, rank=4, d=2, gates=gates).eval()
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = tt(x)  # caches the merged halves
    tt.train()  # drops the cache: training runs in train mode
    assert "_inference_cache" not in tt.__dict__
    tt(x).pow(2).sum().backward()
    versions = [p._version for p in tt.parameters()]
    torch.optim.AdamW(tt.parameters(), lr=0.1, fused=True).step()
    assert [p._version for p in tt.parameters()] == versions  # the kernel bumps no version counter
    tt.eval()
    with torch.no_grad():
        after = tt(x)
    assert not torch.equal(after, before)
    assert rel_err(after, x @ tt.dense_weight().t() + tt.bias) < 1e-5


def test_a_fused_step_taken_in_eval_mode_is_seen_after_clear_cache():
    tt = TTLinear(64, 48, rank=4, d=2).eval()
    x = torch.randn(3, 64)
    with torch.no_grad():
        tt(x)
    tt(x).pow(2).sum().backward()
    torch.optim.AdamW(tt.parameters(), lr=0.1, fused=True).step()
    tt.clear_cache()
    with torch.no_grad():
        assert rel_err(tt(x), x @ tt.dense_weight().t() + tt.bias) < 1e-5


def test_custom_backward_matches_autograd_through_plain_ops():
    tt = TTLinear(96, 80, rank=6, dtype=torch.float64)
    x = torch.randn(7, 96, dtype=torch.float64, requires_grad=True)
    tt(x).pow(2).sum().backward()
    ours = [x.grad.clone()] + [p.grad.clone() for p in tt.parameters()]
    x.grad = None
    tt.zero_grad()
    (x @ tt.dense_weight().t() + tt.bias).pow(2).sum().backward()
    reference = [x.grad] + [p.grad for p in tt.parameters()]
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(ours, reference))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_autocast_backward_outside_the_autocast_block(layout):
    """As the Trainer runs it: the forward under bf16 autocast on a float32 input (a layer norm's
    output), the backward after the block has closed. Gradients track the float32 ones."""
    torch.manual_seed(0)
    tt = TTLinear.from_linear(nn.Linear(96, 80), rank=8, layout=layout)
    x = torch.randn(32, 96, requires_grad=True)
    tt(x).square().mean().backward()
    reference = [x.grad.clone()] + [p.grad.clone() for p in tt.parameters()]
    x.grad = None
    tt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tt(x)
    assert y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    low = [x.grad] + [p.grad for p in tt.parameters()]
    assert all(g.dtype == torch.float32 for g in low)
    assert all(rel_err(a, b) < 5e-2 for a, b in zip(low, reference))


def _adamw_steps(layer, optimizer, x, steps: int, masks=None) -> None:
    """``steps`` AdamW steps on the mean square of the layer's output; closed gate entries (``masks``)
    are put back to zero after each, as the rank controller does."""
    for _ in range(steps):
        layer(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if masks is not None:
            with torch.no_grad():
                for gate, mask in zip(layer.gates, masks):
                    gate.mul_(mask)
                layer.zero_pruned_()


def test_cutting_closed_ranks_while_training_keeps_the_layer_and_its_optimizer_stepping_alike():
    """A layer cut to its open ranks mid-training (with AdamW's moments) trains on exactly as the
    masked layer it was: same matrix after the cut and after more steps, same parameter objects."""
    import copy

    from comera_convert.training.rank_cuts import moments_cutter

    torch.manual_seed(0)
    cut = TTLinear.from_linear(nn.Linear(64, 48), rank=8, d=2)
    with torch.no_grad():
        cut.gates[0][[0, 3]] = 0.0
        cut.gates[1][[1, 5, 6]] = 0.0
        cut.zero_pruned_()
    masks = [g.detach() != 0 for g in cut.gates]
    masked = copy.deepcopy(cut)
    x = torch.randn(16, 64)
    optimizers = [torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.01) for layer in (masked, cut)]
    _adamw_steps(masked, optimizers[0], x, 2, masks)
    _adamw_steps(cut, optimizers[1], x, 2, masks)
    parameters = [id(p) for p in cut.parameters()]

    keep = cut.cut_to_open_ranks_(moments_cutter(optimizers[1]))
    assert [k.tolist() for k in keep[:2]] == [[1, 2, 4, 5, 6, 7], [0, 2, 3, 4, 7]]
    assert cut.bond_dims == cut.ranks == masked.ranks and cut.bond_dims != masked.bond_dims
    assert [tuple(c.shape) for c in cut.cores] == cut.spec.core_shapes()
    assert [id(p) for p in cut.parameters()] == parameters  # the optimizer still holds them
    assert rel_err(cut.dense_matrix(), masked.dense_matrix()) < 1e-6
    _adamw_steps(masked, optimizers[0], x, 3, masks)
    _adamw_steps(cut, optimizers[1], x, 3)
    assert rel_err(cut.dense_matrix(), masked.dense_matrix()) < 1e-5
    assert rel_err(cut(x), masked(x)) < 1e-5
