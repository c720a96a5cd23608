"""Feed-forward pairs pruned by hidden neuron (--ffn prune): the pruned pair against the dense pair it
replaces, the neurons it keeps, the budget it spends, checkpoints that load back equal, decompression,
and the refusals."""

import dataclasses
import json
import logging

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from torch import nn

import comera_convert
from comera_convert import ConvertOptions
from comera_convert.conversion.plan import ModelShape, plan_for
from comera_convert.conversion.calibration import Calibration, collect
from comera_convert.conversion.pruning import compensate_up, ffn_pairs, kept_multiple, kept_neurons, prune_pair
from comera_convert.conversion.storage import MIN_INTEGER_VALUES, integer_format, train_on_the_grid
from comera_convert.conversion.targets import find_candidates
from comera_convert.errors import ConfigError, ModelLoadError
from comera_convert.integer import fake_quantize
from comera_convert.layers import PrunedLinear, TTLinear
from comera_convert.tt.counting import num_params

from .conftest import rel_err
from .tiny_models import build, outputs

torch.manual_seed(0)


def _pair(width=16, hidden=48):
    up, down = nn.Linear(width, hidden), nn.Linear(hidden, width)
    return up, down


def _run(up, down, x):
    return down(nn.functional.gelu(up(x)))


def _statistics(up, x, name="down") -> Calibration:
    """Dense input statistics of down (the hidden activations) on rows ``x``."""
    h = nn.functional.gelu(up(x)).double()
    return Calibration(grams={name: h.T @ h}, sums={name: h.sum(0)}, rows={name: len(h)})


@torch.no_grad()
def test_keeping_every_neuron_reproduces_the_dense_pair():
    up, down = _pair()
    x = torch.randn(400, 16)
    new_up, new_down = prune_pair(up, down, 48, "down", _statistics(up, x))
    assert rel_err(_run(new_up, new_down, x), _run(up, down, x)) < 1e-2  # the refit's ridge only


@torch.no_grad()
def test_the_neurons_down_ignores_are_the_ones_pruned_and_the_rest_is_exact():
    up, down = _pair()
    down.weight[:, 32:] = 0  # neurons 32..47 reach no output
    x = torch.randn(400, 16)
    new_up, new_down = prune_pair(up, down, 32, "down", _statistics(up, x))
    assert torch.equal(new_up.weight, up.weight[:32]) and torch.equal(new_up.bias, up.bias[:32])
    assert rel_err(_run(new_up, new_down, x), _run(up, down, x)) < 1e-2


@torch.no_grad()
def test_the_refit_beats_dropping_the_neurons_on_held_out_rows():
    up, down = _pair()
    x, held_out = torch.randn(600, 16), torch.randn(200, 16)
    new_up, new_down = prune_pair(up, down, 24, "down", _statistics(up, x))
    keep = [int((up.weight == row).all(1).nonzero()) for row in new_up.weight]
    dropped = nn.Linear(24, 16)
    dropped.weight.copy_(down.weight[:, keep])
    dropped.bias.copy_(down.bias)
    dense = _run(up, down, held_out)
    refit_error = rel_err(_run(new_up, new_down, held_out), dense)
    drop_error = rel_err(_run(new_up, dropped, held_out), dense)
    assert refit_error < 0.7 * drop_error, (refit_error, drop_error)


@torch.no_grad()
def test_expanded_layers_compute_the_same_pair_at_the_dense_shapes():
    up, down = _pair()
    x = torch.randn(50, 16)
    new_up, new_down = prune_pair(up, down, 20, "down", _statistics(up, x))
    wide_up, wide_down = new_up.expanded(), new_down.expanded()
    assert (wide_up.out_features, wide_down.in_features) == (48, 48)
    assert rel_err(_run(wide_up, wide_down, x), _run(new_up, new_down, x)) < 1e-6


def test_pairs_are_the_feed_forward_layers_the_allocation_compresses():
    model = build("bert")
    candidates = find_candidates(model)[0]
    specs = [object()] * len(candidates)
    pairs = ffn_pairs(candidates, specs)
    assert pairs == {f"encoder.layer.{i}.intermediate.dense": f"encoder.layer.{i}.output.dense" for i in range(2)}
    names = [c.name for c in candidates]
    specs[names.index("encoder.layer.1.output.dense")] = None  # kept dense: its up stays low-rank
    assert list(ffn_pairs(candidates, specs)) == ["encoder.layer.0.intermediate.dense"]
    assert ffn_pairs(find_candidates(build("gpt2"))[0], specs) == {}  # GPT-2's Conv1D pair is not pruned


def _calibrated(case="bert"):
    model = build(case).eval()
    batches = [torch.randint(3, 500, (16, 24), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    return model, collect(model, find_candidates(model)[0], batches, source="test")


def test_a_pruned_conversion_spends_no_more_than_the_low_rank_one_and_keeps_more(tmp_path):
    reference = build("bert").eval()
    results = {}
    for ffn in ("low-rank", "prune"):
        model, stats = _calibrated()
        report = comera_convert.convert(model, rank=8, calibration=stats, ffn=ffn)
        results[ffn] = (model, report)
    (low_rank, low_report), (pruned, report) = results["low-rank"], results["prune"]
    up, down = pruned.encoder.layer[0].intermediate.dense, pruned.encoder.layer[0].output.dense
    assert isinstance(up, PrunedLinear) and isinstance(down, PrunedLinear) and up.kept == down.kept < 128
    assert isinstance(pruned.encoder.layer[0].attention.output.dense, TTLinear)
    # The same budget, less what rounding the kept neurons down (a neuron: 64 + 1 + 64 parameters a
    # pair) and the low-rank layers' rank gates (parameters too, which the pruned pair has none of) leave.
    gates = sum(p.numel() for name, p in low_rank.named_parameters() if ".gates." in name and "dense" in name
                and ("intermediate" in name or ".output.dense" in name and "attention" not in name))
    assert low_report.params_after - 2 * (64 + 1 + 64) - gates <= report.params_after <= low_report.params_after
    rows = {row.name: row for row in report.modules}
    assert rows["encoder.layer.0.intermediate.dense"].layout == "pruned"
    assert rows["encoder.layer.0.intermediate.dense"].ranks == [up.kept]
    x = {"input_ids": torch.randint(3, 500, (4, 24), generator=torch.Generator().manual_seed(9))}
    dense = outputs(reference, x)
    assert rel_err(outputs(pruned.eval(), x), dense) < rel_err(outputs(low_rank.eval(), x), dense)


def test_kept_neurons_match_the_two_low_rank_specs_budget():
    model = build("bert")
    candidates = {c.name: c for c in find_candidates(model)[0]}
    up, down = candidates["encoder.layer.0.intermediate.dense"], candidates["encoder.layer.0.output.dense"]
    options = ConvertOptions(rank=8, d=1)
    from comera_convert.conversion.converter import layout_choice

    choice = layout_choice(model, list(candidates.values()), plan_for(options, ModelShape(1_000, None)))
    up_spec, down_spec = choice.spec(up, 8), choice.spec(down, 8)
    kept = kept_neurons(up, up_spec, down, down_spec)
    low_rank = num_params(up_spec) + num_params(down_spec) + 128  # up's bias is full width there
    assert kept * (64 + 1 + 64) <= low_rank < (kept + 1) * (64 + 1 + 64)
    in_eights = kept_neurons(up, up_spec, down, down_spec, 8)  # a rank multiple (or int4's 16)
    assert in_eights % 8 == 0 and kept - 8 < in_eights <= kept


def test_kept_neurons_split_into_the_integer_groups_asked_for():
    # A group size given for integer storage must divide down's rows, which are as long as the neurons kept.
    assert kept_multiple(1, "int4", 32) == 32 and kept_multiple(8, "int8", 48) == 48
    assert kept_multiple(8, "int4", None) == 16  # int4's own groups, chosen to divide what is kept
    assert kept_multiple(8, "int8", None) == 8 and kept_multiple(8, None, None) == 8
    model, stats = _calibrated("bert-mlm")
    report = comera_convert.convert(model, ConvertOptions(ratio=3, ffn="prune", dtype="int4", group_size=32),
                                    calibration=stats)
    kept = [row.ranks[0] for row in report.modules if row.layout == "pruned"]
    assert kept and all(count % 32 == 0 for count in kept), kept


def test_a_pruned_checkpoint_loads_back_equal_and_decompresses_to_the_dense_shapes(tmp_path):
    model, stats = _calibrated("bert-mlm")
    comera_convert.convert(model, rank=8, calibration=stats, ffn="prune")
    model.save_pretrained(tmp_path / "tt")
    quantization = json.loads((tmp_path / "tt" / "config.json").read_text())["quantization_config"]
    assert quantization["version"] == 5
    record = quantization["modules"]["bert.encoder.layer.0.output.dense"]
    assert record["kind"] == "pruned_linear" and record["pruned"] == "in" and record["dense_features"] == 128
    loaded = tf.AutoModelForMaskedLM.from_pretrained(tmp_path / "tt").eval()
    assert isinstance(loaded.bert.encoder.layer[1].intermediate.dense, PrunedLinear)
    assert torch.equal(outputs(loaded), outputs(model.eval()))
    dense = comera_convert.decompress_model(loaded)
    dense.save_pretrained(tmp_path / "dense")
    plain = tf.AutoModelForMaskedLM.from_pretrained(tmp_path / "dense").eval()
    assert type(plain.bert.encoder.layer[0].output.dense) is nn.Linear
    assert plain.bert.encoder.layer[0].intermediate.dense.out_features == 128
    assert rel_err(outputs(plain), outputs(model)) < 1e-5


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_an_integer_pruned_checkpoint_stores_the_pruned_layers_as_integers_and_loads_back_equal(dtype, tmp_path):
    model, stats = _calibrated("bert-mlm")
    # rank 30: the pair's budget buys 102 neurons (96 under int4, a multiple of 16 for its groups), so
    # each side holds at least 96 x 64 values, above MIN_INTEGER_VALUES.
    comera_convert.convert(model, rank=30, calibration=stats, ffn="prune", dtype=dtype)
    up, down = model.bert.encoder.layer[0].intermediate.dense, model.bert.encoder.layer[0].output.dense
    assert isinstance(up, PrunedLinear) and min(up.weight.numel(), down.weight.numel()) >= MIN_INTEGER_VALUES
    assert up.kept == (96 if dtype == "int4" else 102)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as stored:
        for name in ("intermediate.dense", "output.dense"):
            key = f"bert.encoder.layer.0.{name}.weight"
            assert stored.get_slice(key).get_dtype() in ("I8", "U8") and f"{key}_scale" in stored.keys()
    loaded = comera_convert.from_pretrained(tmp_path).eval()
    assert isinstance(loaded.bert.encoder.layer[0].output.dense, PrunedLinear)
    assert torch.equal(outputs(loaded), outputs(model.eval()))  # rounded as made: in memory as stored
    float_model, float_stats = _calibrated("bert-mlm")
    comera_convert.convert(float_model, rank=30, calibration=float_stats, ffn="prune")
    dense = outputs(build("bert-mlm").eval())
    # int8 rounds the pruned layers by less than the pruning changes them; int4 within twice that
    bound = 1.05 if dtype == "int8" else 2
    assert rel_err(outputs(loaded), dense) < bound * rel_err(outputs(float_model.eval()), dense)


def test_on_the_grid_a_pruned_layer_runs_on_its_rounded_weight_and_passes_gradients():
    model, stats = _calibrated()
    comera_convert.convert(model, rank=32, calibration=stats, ffn="prune")
    up = model.encoder.layer[0].intermediate.dense
    x = torch.randn(5, 64)
    floats = up(x)
    fmt = integer_format("int4")
    train_on_the_grid(model, fmt)
    assert up.integer_format is fmt
    on_grid = up(x)
    assert torch.allclose(on_grid, nn.functional.linear(x, fake_quantize(up.weight, fmt, 0), up.bias))
    assert not torch.allclose(on_grid, floats)
    on_grid.sum().backward()
    assert up.weight.grad is not None and up.weight.grad.abs().sum() > 0
    train_on_the_grid(model, None)
    assert up.integer_format is None and torch.equal(up(x), floats)


@pytest.mark.parametrize("case", ["gpt2", "llama-clm"])
def test_a_model_without_a_bert_family_pair_says_its_feed_forward_layers_stay_low_rank(case, caplog):
    model, stats = _calibrated(case)
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        comera_convert.convert(model, rank=8, calibration=stats, ffn="prune")
    assert "--ffn prune found no feed-forward pair to prune" in caplog.text
    assert not any(isinstance(m, PrunedLinear) for m in model.modules())
    assert any(isinstance(m, TTLinear) for m in model.modules())


def test_training_gives_a_pruned_layers_weight_the_factors_rate_and_its_bias_the_rest():
    from comera_convert.training import TrainOptions
    from comera_convert.training.trainer import parameter_groups

    model, stats = _calibrated()
    comera_convert.convert(model, rank=8, calibration=stats, ffn="prune")
    groups = {g["name"]: (g["lr"], {id(p) for p in g["params"]}) for g in
              parameter_groups(model, TrainOptions(objective="distill", lr_cores=1e-3, lr_rest=1e-4))}
    down = model.encoder.layer[1].output.dense
    assert isinstance(down, PrunedLinear)
    assert id(down.weight) in groups["cores"][1] and groups["cores"][0] == 1e-3
    assert id(down.bias) in groups["rest"][1] and groups["rest"][0] == 1e-4


def test_a_damaged_pruned_record_is_refused_in_one_line(tmp_path):
    model, stats = _calibrated()
    comera_convert.convert(model, rank=8, calibration=stats, ffn="prune")
    model.save_pretrained(tmp_path / "tt")
    config_path = tmp_path / "tt" / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"]["modules"]["encoder.layer.0.output.dense"]["dense_features"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'encoder.layer.0.output.dense' is not a valid pruned linear"):
        comera_convert.from_pretrained(tmp_path / "tt")


def test_refusals_say_what_was_expected():
    with pytest.raises(ConfigError, match=r"ffn in \('low-rank', 'prune'\).*'lowrank'"):
        ConvertOptions(ratio=2, ffn="lowrank")
    with pytest.raises(ConfigError, match="--ffn prune refits each pruned feed-forward pair on calibration text"):
        comera_convert.convert(build("bert"), rank=8, ffn="prune")
    with pytest.raises(ValueError, match="between 1 and 48 kept out features"):
        PrunedLinear(16, 0, pruned="out", dense_features=48)


@torch.no_grad()
def test_up_is_refit_to_the_compressed_inputs_where_the_calibration_compensates():
    up = nn.Linear(16, 48)
    x = torch.randn(800, 16)
    seen = x @ (torch.eye(16) + 0.2 * torch.randn(16, 16)) + 0.1  # what the compressed layers before give
    stats = Calibration(grams={"up": (seen.T @ seen).double()}, sums={"up": seen.sum(0).double()},
                        rows={"up": 800}, cross={"up": (seen.T @ x).double()}, dense_sums={"up": x.sum(0).double()})
    target, before = up(x), rel_err(up(seen), up(x))
    prune_up = nn.Linear(16, 48)
    prune_up.load_state_dict(up.state_dict())
    compensate_up(prune_up, "up", stats)
    assert rel_err(prune_up(seen), target) < 0.05 * before
    untouched = nn.Linear(16, 48)
    untouched.load_state_dict(up.state_dict())
    compensate_up(untouched, "up", Calibration(grams=stats.grams, sums=stats.sums, rows=stats.rows))
    assert torch.equal(untouched.weight, up.weight)  # no cross statistics: fit to the dense inputs already


def test_putting_back_one_side_of_a_pruned_pair_puts_back_both():
    from comera_convert.evaluation import restore_dense

    model, stats = _calibrated()
    reference = build("bert").eval()
    comera_convert.convert(model, rank=8, calibration=stats, ffn="prune")
    restored = restore_dense(model, reference, ["encoder.layer.0.output.dense"])
    assert sorted(restored) == ["encoder.layer.0.intermediate.dense", "encoder.layer.0.output.dense"]
    assert type(model.encoder.layer[0].intermediate.dense) is nn.Linear
    assert isinstance(model.encoder.layer[1].intermediate.dense, PrunedLinear)
    restore_dense(model, reference, ["intermediate", "attention", "embeddings", "pooler"])
    assert torch.allclose(outputs(model.eval()), outputs(reference), atol=1e-5)  # every module back: dense


@torch.no_grad()
def test_of_two_neurons_that_fire_alike_one_is_pruned_and_the_other_takes_its_part():
    up, down = _pair(hidden=24)
    up.weight[1], up.bias[1] = up.weight[0], up.bias[0]  # neuron 1 repeats neuron 0
    down.weight[:, :2] *= 4  # the two carry the most output energy
    x = torch.randn(600, 16)
    new_up, new_down = prune_pair(up, down, 23, "down", _statistics(up, x))
    assert sum(bool((row == up.weight[0]).all()) for row in new_up.weight) == 1  # one copy is enough
    assert rel_err(_run(new_up, new_down, x), _run(up, down, x)) < 1e-2


@torch.no_grad()
def test_neurons_that_never_fire_are_pruned_without_a_failing_factorization():
    up, down = _pair()
    up.weight[40:], up.bias[40:] = 0, -50  # GELU(-50) is 0: eight dead neurons, a singular covariance
    x = torch.randn(400, 16)
    stats = _statistics(up, x)
    stats.grams["down"][40:, 40:] = 0
    new_up, new_down = prune_pair(up, down, 40, "down", stats)
    assert (new_up.bias > -50).all()  # the dead ones went first
    assert rel_err(_run(new_up, new_down, x), _run(up, down, x)) < 1e-2


def _greedy_by_definition(covariance, target, kept):
    """One neuron at a time, the survivors' least squares solved afresh at each removal: the
    selection surviving_neurons makes by updating C^-1 and the fit in place."""
    alive = list(range(len(covariance)))
    while len(alive) > kept:
        inverse = torch.linalg.inv(covariance[alive][:, alive])
        fit = inverse @ target[alive]
        saliency = fit.pow(2).sum(1) / inverse.diagonal()
        del alive[int(saliency.argmin())]
    return torch.tensor(alive)


@pytest.mark.parametrize("kept", [1, 13, 39])
def test_the_in_place_updates_select_the_neurons_the_greedy_definition_selects(kept):
    from comera_convert.conversion import pruning

    h = torch.randn(500, 40, dtype=torch.float64) * torch.rand(40, dtype=torch.float64)
    covariance, target = h.T @ h, torch.randn(40, 6, dtype=torch.float64)
    assert 40 - kept <= pruning.REMOVAL_GROUPS  # a group a neuron: exactly the definition's order
    inverse = torch.linalg.inv(covariance)
    keep = pruning.surviving_neurons(inverse, inverse @ target, kept)
    assert torch.equal(keep, _greedy_by_definition(covariance, target, kept))


def test_a_covariance_rounding_left_indefinite_is_damped_before_it_is_inverted():
    from comera_convert.conversion import pruning

    covariance = torch.diag(torch.tensor([1.0, 1.0, 1.0, -1e-4]))  # what float32 rounding can leave
    inverse = pruning._inverse(covariance)
    damping = 10 * pruning.REFIT_RIDGE * float(covariance.diagonal().mean())
    assert torch.allclose(inverse @ (covariance + damping * torch.eye(4)), torch.eye(4), atol=1e-5)


def _ffn(options: ConvertOptions) -> str:
    return plan_for(options, ModelShape(params=22_713_216, cut=2.3)).ffn


def test_by_default_a_calibrated_ratio_prunes_and_every_other_conversion_stays_low_rank():
    assert _ffn(ConvertOptions(ratio=4, calibration="english")) == "prune"
    assert _ffn(ConvertOptions(ratio=4)) == "low-rank"  # nothing to refit down on
    assert _ffn(ConvertOptions(rank=8, calibration="english")) == "low-rank"  # CoMERA's TT, for rank adaptation
    assert _ffn(ConvertOptions(ratio=4, calibration="english", allocation="learned")) == "low-rank"
    assert _ffn(ConvertOptions(ratio=4, calibration="english", d=2)) == "low-rank"
    assert _ffn(ConvertOptions(ratio=4, calibration="english", ffn="low-rank")) == "low-rank"
    # comera convert names its default calibration after the request is made: the plan follows it.
    assert _ffn(dataclasses.replace(ConvertOptions(ratio=4), calibration="english")) == "prune"
    assert _ffn(dataclasses.replace(ConvertOptions(ratio=4, calibration="english"), calibration=None)) == "low-rank"
    assert ConvertOptions(ratio=4, calibration="english").ffn is None  # left to the plan
    planned = plan_for(ConvertOptions(ratio=4, calibration="english", ffn="prune"), ModelShape(1_000, 2.0))
    assert planned.reasons["ffn"] == "given"


def test_the_default_on_a_model_without_a_bert_family_pair_stays_low_rank_without_a_warning(caplog):
    model, stats = _calibrated("gpt2")
    options = ConvertOptions(ratio=1.5, calibration="english", reconstruct_steps=0)
    assert _ffn(options) == "prune"
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        comera_convert.convert(model, options, calibration=stats)
    assert "--ffn prune" not in caplog.text
    assert any(isinstance(m, TTLinear) for m in model.modules())
    assert not any(isinstance(m, PrunedLinear) for m in model.modules())


def test_a_target_ratio_gates_the_pruned_pairs_neurons_beside_the_tt_ranks(caplog):
    from comera_convert.training import TrainOptions
    from comera_convert.training.plan import plan_training
    from comera_convert.training.neuron_gates import NeuronBond
    from comera_convert.training.rank_control import RankController

    model, stats = _calibrated()
    dense = sum(p.numel() for p in model.parameters())
    report = comera_convert.convert(model, rank=8, calibration=stats, ffn="prune")
    options = plan_training(TrainOptions(steps=100, target_ratio=1.2 * dense / report.params_after), "mlm")
    with caplog.at_level(logging.WARNING, logger="comera_convert.training"):
        controller = RankController(model, options, dense_params=dense)
    assert not [r for r in caplog.records if r.name == "comera_convert.training"]  # nothing left out to warn of
    kinds = [type(module) for _, module in controller.modules]
    assert kinds.count(NeuronBond) == 2 and TTLinear in kinds  # two pairs' neurons, the attention's ranks
    assert all(m.gates is not None for m in model.modules() if isinstance(m, PrunedLinear) and m.pruned == "in")
