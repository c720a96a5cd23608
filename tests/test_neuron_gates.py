"""Neuron gates on pruned feed-forward pairs (training/neuron_gates.py): the gated pair against the pair
it gates, closing and cutting neurons for real, the budget's count, and `comera train --target-ratio` on
the model a default conversion makes (pruned pairs, layers left dense, no TT layer)."""

import copy
import json
import logging
import random

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

import comera_convert
from comera_convert.conversion import count_params
from comera_convert.conversion.calibration import collect
from comera_convert.conversion.targets import find_candidates
from comera_convert.errors import ConfigError
from comera_convert.layers import PrunedLinear, TTModule
from comera_convert.training import TrainOptions, train
from comera_convert.training.plan import plan_training
from comera_convert.training.neuron_gates import NeuronBond, attach_neuron_gates, neuron_bonds, pruned_pairs
from comera_convert.training.rank_control import RankController
from comera_convert.training.trainer import STATE_FILE, load_truncated_checkpoint, truncated_copy

from .tiny_models import outputs, word_tokenizer

# A vocabulary large enough that, as in MiniLM, the word table's codebook holds much of `--ratio 2`'s cut:
# the default conversion then prunes the first feed-forward pair and leaves every other linear dense.
VOCAB = 2000


def _ids(seed: int = 1) -> dict:
    ids = torch.randint(5, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def default_conversion(folder, ratio: float = 2.0):
    """A tiny BERT masked LM converted as `comera convert` does by default (calibrated: codebook word
    table, pruned pairs, layers dense where factors would not be smaller), saved with its dense source
    and a word tokenizer; returns its folder."""
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=64)).eval()
    tokenizer = word_tokenizer(VOCAB)
    model.save_pretrained(folder / "dense")
    tokenizer.save_pretrained(folder / "dense")
    batches = [torch.randint(5, VOCAB, (16, 24), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    stats = collect(model, find_candidates(model)[0], batches, source="test")
    comera_convert.convert(model, ratio=ratio, calibration=stats, ffn="prune", reconstruct_steps=0,
                           source=str(folder / "dense"))
    model.save_pretrained(folder / "converted")
    tokenizer.save_pretrained(folder / "converted")
    return folder / "converted"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    path = default_conversion(tmp_path_factory.mktemp("neurons"))
    model = comera_convert.from_pretrained(path)
    assert any(isinstance(m, PrunedLinear) for m in model.modules())
    assert not any(isinstance(m, TTModule) for m in model.modules())  # the case a target ratio used to refuse
    return path


@pytest.fixture
def words(tmp_path):
    """Text of the tokenizer's words: every token a real id."""
    folder = tmp_path / "words"
    folder.mkdir()
    draw = random.Random(0)
    for i in range(4):
        lines = (" ".join(f"w{draw.randrange(400)}" for _ in range(40)) for _ in range(150))
        (folder / f"part{i}.txt").write_text("\n".join(lines))
    return folder


def _dense_params(path) -> int:
    return json.loads((path / "config.json").read_text())["quantization_config"]["dense_params"]


def _gated(path):
    model = comera_convert.from_pretrained(path).eval()
    assert attach_neuron_gates(model) >= 1
    return model, neuron_bonds(model)


def test_a_gate_of_ones_computes_what_the_pair_did(converted):
    plain = comera_convert.from_pretrained(converted).eval()
    model, bonds = _gated(converted)
    name, bond = bonds[0]
    assert bond.down is model.get_submodule(name) and bond.up.pruned == "out" and bond.down.pruned == "in"
    assert bond.ranks == bond.bond_dims == (bond.up.out_features,)
    torch.testing.assert_close(outputs(model, _ids()), outputs(plain, _ids()))
    assert attach_neuron_gates(model) == len(bonds)  # attaching again changes nothing
    assert len(bond.gates[0]) == bond.down.in_features


def test_a_closed_neuron_computes_nothing_and_cutting_it_out_narrows_both_layers(converted):
    model, [(_, bond)] = _gated(converted)
    with torch.no_grad():
        bond.gates[0].uniform_(0.5, 1.5)
        bond.gates[0][::3] = 0
    bond.zero_pruned_()
    width, kept = bond.bond_dims[0], bond.ranks[0]
    closed = (bond.gates[0] == 0).nonzero().flatten()
    assert bond.up.weight[closed].abs().sum() == 0 and bond.up.bias[closed].abs().sum() == 0
    assert bond.down.weight[:, closed].abs().sum() == 0
    before = outputs(model, _ids())
    weight = bond.up.weight
    keep = bond.cut_to_open_ranks_()
    assert bond.up.weight is weight  # the same parameter, only smaller: an optimizer holding it steps on
    assert len(keep[0]) == kept < width
    assert bond.up.weight.shape == (kept, 64) and bond.down.weight.shape == (64, kept)
    assert bond.up.out_features == bond.down.in_features == bond.bond_dims[0] == bond.ranks[0] == kept
    torch.testing.assert_close(outputs(model, _ids()), before, atol=1e-5, rtol=1e-4)


def test_the_export_folds_the_gate_into_a_plain_pruned_layer_that_loads_back_equal(converted, tmp_path):
    model, [(name, bond)] = _gated(converted)
    with torch.no_grad():
        bond.gates[0].uniform_(0.5, 1.5)
        bond.gates[0][:40] = 0
    bond.zero_pruned_()
    before = outputs(model, _ids())
    export, kept = truncated_copy(model, fold=True)
    down = export.get_submodule(name)
    assert down.gates is None and down.in_features == len(kept[name][0]) == bond.ranks[0]
    torch.testing.assert_close(outputs(export, _ids()), before, atol=1e-5, rtol=1e-4)
    export.save_pretrained(tmp_path / "export")
    loaded = comera_convert.from_pretrained(tmp_path / "export").eval()
    assert loaded.get_submodule(name).kept == bond.ranks[0]
    torch.testing.assert_close(outputs(loaded, _ids()), before, atol=1e-5, rtol=1e-4)


def test_a_training_checkpoint_of_a_cut_pair_restores_it_at_its_width(converted):
    model, [(name, bond)] = _gated(converted)
    with torch.no_grad():
        bond.gates[0].uniform_(0.5, 1.5)
        bond.gates[0][1::4] = 0
    bond.zero_pruned_()
    truncated, kept = truncated_copy(model, fold=False)
    tensors = {k: v.clone() for k, v in truncated.state_dict().items()}
    fresh, [(_, restored)] = _gated(converted)
    restored.restore_(dict(tensors), (pruned_pairs(model)[0][0], name), kept[name][0], bond.bond_dims[0])
    for mine, theirs in zip(restored.cores + restored.gates, bond.cores + bond.gates):
        torch.testing.assert_close(mine, theirs)
    with pytest.raises(Exception, match="kept neurons of 3"):
        _gated(converted)[1][0][1].restore_(dict(tensors), (pruned_pairs(model)[0][0], name), kept[name][0], 3)


def test_the_budget_counts_a_neuron_as_its_row_its_bias_and_its_column(converted):
    model = comera_convert.from_pretrained(converted).eval()
    options = plan_training(TrainOptions(steps=100, target_ratio=3.0), "mlm")
    controller = RankController(model, options, _dense_params(converted))
    bonds = [m for _, m in controller.modules if isinstance(m, NeuronBond)]
    assert bonds and controller.gated_pairs == len(bonds)
    with torch.no_grad():
        bonds[0].gates[0][:30] = 0
    controller.sync_open()
    controller.prune()
    truncated, _ = truncated_copy(model, fold=True)
    assert controller.model_params() == count_params(truncated)


def test_from_a_default_conversion_a_target_ratio_closes_neurons_and_opens_the_dense_layers(converted, tmp_path,
                                                                                           words, caplog):
    conversion = comera_convert.from_pretrained(converted)
    kept_before = {n: m.kept for n, m in conversion.named_modules() if isinstance(m, PrunedLinear)}
    dense = _dense_params(converted)
    options = TrainOptions(objective="mlm", data=str(words), steps=24, seq_len=32, batch_size=4, lr_cores=2e-3,
                           lr_rest=2e-3, lr_gates=1e-3, save_steps=12, max_eval_blocks=8, early_steps=4,
                           target_ratio=3.0)
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        result = train(str(converted), options, tmp_path / "out")
    assert "keep their neurons" not in caplog.text
    assert result.shortfall is None and result.opened_layers  # the attention layers joined the budget
    trained = comera_convert.from_pretrained(tmp_path / "out").eval()
    assert 3.0 <= dense / count_params(trained) <= 3.0 * 1.02
    kept_after = {n: m.kept for n, m in trained.named_modules() if isinstance(m, PrunedLinear)}
    assert kept_after.keys() == kept_before.keys()
    assert all(kept_after[n] < kept_before[n] for n in kept_after)  # neurons cut out for real
    assert all(m.gates is None for m in trained.modules() if isinstance(m, PrunedLinear))
    assert any(cut["params_after"] < cut["params_before"] for cut in result.rank_cuts)


@pytest.mark.skipif(not __import__("tests.test_train", fromlist=["_resume_supported"])._resume_supported(),
                    reason="transformers reads optimizer states with torch.load only on torch >= 2.6")
def test_a_run_resumed_across_a_cut_that_narrowed_a_pair_continues_exactly(converted, tmp_path, words):
    from .test_train import StopAt, assert_trained_alike

    options = TrainOptions(objective="mlm", data=str(words), steps=12, seq_len=32, batch_size=4, lr_cores=2e-3,
                           lr_rest=2e-3, lr_gates=1e-3, save_steps=6, max_eval_blocks=8, early_steps=3,
                           budget_share=0.3, target_ratio=2.6)
    train(str(converted), options, tmp_path / "straight")
    train(str(converted), options, tmp_path / "resumed", callbacks=[StopAt(6)])
    saved = json.loads((tmp_path / "resumed" / "checkpoints" / "checkpoint-6" / STATE_FILE).read_text())
    down = next(n for n, m in comera_convert.from_pretrained(converted).named_modules()
                if isinstance(m, PrunedLinear) and m.pruned == "in")
    full = comera_convert.from_pretrained(converted).get_submodule(down).in_features
    assert saved["controller"]["cuts"] and saved["bond_dims"][down][0] < full  # the pair was narrowed
    train(str(converted), options, tmp_path / "resumed", resume=True)
    assert_trained_alike(tmp_path / "straight", tmp_path / "resumed", atol=1e-5)


def test_a_checkpoint_is_restored_into_a_model_whose_pair_was_not_yet_cut(converted, tmp_path):
    model, [(name, bond)] = _gated(converted)
    with torch.no_grad():
        bond.gates[0][::2] = 0
    bond.zero_pruned_()
    bond.cut_to_open_ranks_()
    truncated, kept = truncated_copy(model, fold=False)
    truncated.save_pretrained(tmp_path / "checkpoint", safe_serialization=True)
    state = {"kept": kept, "bond_dims": {name: list(bond.bond_dims)}}
    (tmp_path / "checkpoint" / STATE_FILE).write_text(json.dumps(state))
    fresh, [(_, restored)] = _gated(converted)
    load_truncated_checkpoint(fresh, str(tmp_path / "checkpoint"))
    assert restored.bond_dims == bond.bond_dims
    torch.testing.assert_close(outputs(fresh, _ids()), outputs(model, _ids()), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("problem,expected", [
    ("below the checkpoint", "target ratio 1.5 is not above the model's current ratio"),
    ("beyond one neuron and rank 1", r"target ratio 1000 is beyond what the smallest ranks allow: .* every bond "
                                     r"at its floor \(rank 1\)"),
    ("nothing to adapt", "no TT layers and no pruned feed-forward pairs.*give --target-ratio")])
def test_targets_the_gates_cannot_head_for_are_refused_in_one_line(converted, tmp_path, words, problem, expected):
    path = converted
    target = {"below the checkpoint": 1.5, "beyond one neuron and rank 1": 1000.0, "nothing to adapt": None}[problem]
    if problem == "nothing to adapt":  # no pruned pair and no TT layer: without a target nothing opens
        path = default_conversion(tmp_path, ratio=1.5)
        assert not any(isinstance(m, (PrunedLinear, TTModule)) for m in comera_convert.from_pretrained(path).modules())
    options = TrainOptions(objective="mlm", data=str(words), steps=12, seq_len=32, batch_size=4, target_ratio=target)
    with pytest.raises(ConfigError, match=expected) as error:
        train(str(path), options, tmp_path / "out")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_a_budget_that_would_empty_a_pair_keeps_one_neuron_and_says_so_in_one_line(converted, caplog):
    model = comera_convert.from_pretrained(converted).eval()
    dense = _dense_params(converted)
    probe = RankController(copy.deepcopy(model), plan_training(TrainOptions(steps=100, target_ratio=2.5), "mlm"),
                           dense)
    ceiling = probe.ceiling(probe.floors_at(0.0))  # every bond at rank 1, every pair at one neuron
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        controller = RankController(model, plan_training(TrainOptions(steps=100, target_ratio=0.99 * ceiling), "mlm"),
                                    dense)
    assert controller.kept_share == 0.0
    assert all(floor >= 1 for floors in controller.floors for floor in floors)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "one neuron" in warnings[0] and "\n" not in warnings[0]


def test_a_neuron_gate_trains_at_the_gates_rate_and_the_pairs_weights_at_the_factors(converted):
    from comera_convert.training.trainer import parameter_groups

    model, [(name, bond)] = _gated(converted)
    options = plan_training(TrainOptions(steps=10), "mlm")
    groups = {group["name"]: {id(p) for p in group["params"]} for group in parameter_groups(model, options)}
    assert id(bond.gates[0]) in groups["gates"]
    assert {id(bond.up.weight), id(bond.down.weight)} <= groups["cores"]
