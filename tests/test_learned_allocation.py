"""The learned rank allocation: the soft-truncated layers it learns through, the exact budget, the
conversion it feeds (in memory and streamed), rank scales given back, and bad input."""

import dataclasses
import pytest
import torch
from torch import nn

import comera_convert
from comera_convert.api import convert_checkpoint
from comera_convert.conversion import ConvertOptions, count_params, plan
from comera_convert.conversion.calibration import collect
from comera_convert.conversion.converter import allocation_request
from comera_convert.conversion.learned import SoftTruncated, breakeven_rank, learn_rank_scales
from comera_convert.conversion.strategies import learn_allocation
from comera_convert.conversion.targets import find_candidates
from comera_convert.errors import ConfigError

from .test_calibration import anisotropic_inputs, skewed_batches
from .test_cli import run
from .test_streaming import _with_tokenizer
from .tiny_models import build


def _layer_and_inputs(rows=24, cols=16):
    torch.manual_seed(0)
    layer = nn.Linear(rows, cols)
    x = anisotropic_inputs(rows, tokens=300).float()
    return layer, x, (x.T @ x).double()


def test_a_soft_truncated_layer_with_every_direction_open_is_the_dense_layer():
    layer, x, gram = _layer_and_inputs()
    soft = SoftTruncated(layer, gram, cap=16)
    soft.mask = torch.ones(16)
    assert torch.allclose(soft(x), layer(x), atol=1e-4, rtol=1e-4)


def test_closing_its_last_directions_is_the_best_truncation_on_the_inputs():
    """The directions are ordered by what they carry of the output on the inputs: the error on them
    grows as directions close, and at every rank it is below a plain SVD truncation's."""
    layer, x, gram = _layer_and_inputs()
    soft = SoftTruncated(layer, gram, cap=16)
    u, s, vh = torch.linalg.svd(layer.weight.detach().double(), full_matrices=False)
    errors = []
    for k in (2, 6, 10, 14):
        soft.mask = (torch.arange(16) < k).float()
        with torch.no_grad():
            error = float((soft(x) - layer(x)).norm())
            plain = ((u[:, :k] * s[:k]) @ vh[:k]).float()
            plain_error = float((x @ plain.T - x @ layer.weight.T).norm())
        assert error < plain_error
        errors.append(error)
    assert errors == sorted(errors, reverse=True)


def _dense_and_statistics():
    dense = build("bert")
    return dense, collect(dense, find_candidates(dense)[0], skewed_batches(), source="test")


def test_the_learned_ranks_keep_the_uniform_budget_and_leave_the_model_as_it_was():
    dense, statistics = _dense_and_statistics()
    request = allocation_request(dense, plan(ConvertOptions(ratio=3), dense))
    before = {name: value.clone() for name, value in dense.state_dict().items()}
    types = [type(m) for m in dense.modules()]
    layers = [c for c in request.candidates if c.kind == "linear" and c.name.startswith("encoder.")]
    base = {c.name: 1.0 for c in layers}
    learned = learn_rank_scales(dense, layers, base, 6, list(statistics.probe.split(8)), steps=30)
    assert [type(m) for m in dense.modules()] == types
    assert all(torch.equal(value, before[name]) for name, value in dense.state_dict().items())
    spent = sum(learned.scales[c.name] * 6 * (c.rows + c.cols) for c in layers)
    assert not any(learned.scales[c.name] * 6 >= breakeven_rank(c) - 1e-6 for c in layers)  # none clamped here
    assert spent == pytest.approx(sum(6 * (c.rows + c.cols) for c in layers), rel=1e-3)  # scales to 3 decimals
    assert len({round(s, 3) for s in learned.scales.values()}) > 3  # the ranks moved apart
    assert learned.distance_after < learned.distance_before


def test_a_learned_conversion_meets_the_ratio_and_records_its_ranks():
    dense, statistics = _dense_and_statistics()
    model = build("bert")
    report = comera_convert.convert(model, ratio=3, calibration=statistics, allocation="learned", learning_steps=30)
    assert report.ratio >= 3 and count_params(model) <= count_params(dense) / 3
    assert report.extra["allocation"].startswith("learned")
    scales = report.extra["rank_scales"]
    # Every linear of the blocks but the last, which keeps the uniform allocation's 2x.
    assert set(scales) == {c.name for c in find_candidates(dense)[0] if c.name.startswith("encoder.layer.0.")}
    before, after = report.extra["learned_distance"]
    assert after < before and report.extra["learning_steps"] == 30
    ranks = {m.name: m.ranks[0] for m in report.modules if m.ranks}
    assert ranks["encoder.layer.0.intermediate.dense"] != ranks["encoder.layer.0.attention.self.query"]
    # The scales a report records convert again to the same model, without learning.
    again = build("bert")
    given = comera_convert.convert(again, ratio=3, calibration=statistics, allocation="learned", rank_scales=scales)
    assert given.modules == report.modules and "learned_distance" not in given.extra
    x = torch.randint(0, 40, (2, 16))
    assert torch.allclose(again(input_ids=x).last_hidden_state, model(input_ids=x).last_hidden_state, atol=1e-5)


@pytest.mark.slow  # 23 s: the CLI test below learns and streams too, in the fast suite
def test_a_streamed_learned_conversion_learns_first_and_then_streams(tmp_path):
    dense, _, cls = _with_tokenizer(tmp_path, "bert")
    options = ConvertOptions(ratio=12, allocation="learned", calibration="english", calibration_seq_len=32,
                             calibration_sequences=32, learning_steps=5, reconstruct_steps=0)
    result = convert_checkpoint(str(dense), tmp_path / "tt", options)
    report = result.report
    assert report.extra["streamed"] and report.extra["allocation"].startswith("learned")
    assert "allocate" in result.timings and report.extra["learning_steps"] == 5
    assert report.ratio == pytest.approx(12, rel=0.02)
    again = convert_checkpoint(str(dense), tmp_path / "again",
                               dataclasses.replace(options, rank_scales=report.extra["rank_scales"]))
    assert again.report.modules == report.modules and "allocate" not in again.timings
    x = torch.randint(0, 1000, (2, 16))
    first, second = (cls.from_pretrained(tmp_path / out).eval() for out in ("tt", "again"))
    assert torch.allclose(first(input_ids=x).last_hidden_state, second(input_ids=x).last_hidden_state, atol=1e-5)


def test_the_learned_allocation_refuses_what_it_cannot_use():
    dense, statistics = _dense_and_statistics()
    with pytest.raises(ConfigError, match="give allocation learned with them, not 'uniform'"):
        ConvertOptions(ratio=3, rank_scales={"encoder.layer.0.output.dense": 2.0})
    with pytest.raises(ConfigError, match=r"rank_scales as a mapping .* numbers in \(0, 64"):
        ConvertOptions(ratio=3, allocation="learned", rank_scales={"encoder.layer.0.output.dense": -1})
    with pytest.raises(ConfigError, match="learning_steps as a positive whole number"):
        ConvertOptions(ratio=3, allocation="learned", learning_steps=0)
    with pytest.raises(ConfigError, match="--modes 1.*got --modes 3"):
        ConvertOptions(ratio=3, allocation="learned", word_embedding="tt", d=3)
    with pytest.raises(ConfigError, match="rank_scales name encoder.layer.9.output.dense, which is not a linear"):
        comera_convert.convert(build("bert"), ratio=3, allocation="learned",
                               rank_scales={"encoder.layer.9.output.dense": 1.5})
    with pytest.raises(ConfigError, match="allocation 'learned' needs calibration data"):
        comera_convert.convert(build("bert"), ratio=3, allocation="learned")
    with pytest.raises(ConfigError, match="found no linear layer to learn before the last block"):
        comera_convert.convert(build("bert"), ratio=1.2, calibration=statistics, allocation="learned",
                               targets=["encoder.layer.1.*"])
    request = allocation_request(dense, plan(ConvertOptions(ratio=3), dense))
    with pytest.raises(ValueError, match="at least two batches"):
        learn_allocation(request, [statistics.probe[:8]])


def test_the_cli_learns_the_allocation_and_says_so(tmp_path):
    dense, _, _ = _with_tokenizer(tmp_path, "bert")
    result = run("convert", dense, "--ratio", 12, "--allocation", "learned", "--learning-steps", 3,
                 "--reconstruct-steps", 0, "--calibration", "english", "--calibration-sequences", 32,
                 "--out", tmp_path / "tt")
    assert result.exit_code == 0, result.output
    assert "learned allocation" in result.output and "(3 steps" in result.output and "(allocate " in result.output
    refused = run("convert", dense, "--ratio", 12, "--allocation", "learned", "--no-calibration",
                  "--out", tmp_path / "plain")
    assert refused.exit_code != 0 and "learns the ranks on calibration text" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
