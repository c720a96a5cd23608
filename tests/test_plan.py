"""The request and its plan: the request holds only what the user gave, the plan derives every default once for a
model (each with its reason), the report stores the plan and `comera report` prints it."""

import dataclasses
import json

import pytest
from click.testing import CliRunner

import comera_convert
from comera_convert.cli import main
from comera_convert.conversion import ConvertRequest, plan
from comera_convert.conversion.plan import GIVEN, ModelShape, plan_for
from comera_convert.errors import ConfigError

from .tiny_models import build

DERIVED = ("ratio", "word_embedding", "d", "compensate", "ffn", "calibration_sequences", "reconstruct_steps",
           "learning_steps")


def test_the_request_leaves_open_what_the_plan_chooses():
    request = ConvertRequest(ratio=4, calibration="english")
    assert (request.d, request.compensate, request.ffn, request.word_embedding, request.reconstruct_steps) == \
        (None, None, None, None, None)
    planned = plan_for(request, ModelShape(params=22_713_216, cut=2.3, block_params=1_800_000))
    assert (planned.d, planned.compensate, planned.ffn, planned.word_embedding) == (1, True, "prune", "codebook")
    assert set(DERIVED) <= set(planned.reasons) and planned.reasons["cut"]
    assert all(planned.reasons[name] != GIVEN for name in DERIVED if name != "ratio")
    assert planned.reasons["ratio"] == GIVEN
    assert planned.layout == request.layout == "tt"  # what was given is read through to the request
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.d = 3


def test_given_options_stay_as_given_with_that_reason():
    request = ConvertRequest(ratio=4, d=2, compensate=False, ffn="low-rank", calibration_sequences=64,
                             reconstruct_steps=10, learning_steps=7, word_embedding="tt")
    planned = plan_for(request, ModelShape(params=22_713_216, cut=2.3, block_params=1_800_000))
    assert [getattr(planned, name) for name in DERIVED[1:]] == ["tt", 2, False, "low-rank", 64, 10, 7]
    assert all(planned.reasons[name] == GIVEN for name in DERIVED)


def test_a_rank_replaces_the_ratio_in_one_place():
    """Whether the rank comes from a Python call, a recipe or the command line, the plan's budget is the rank."""
    planned = plan_for(ConvertRequest(ratio=8, rank=6), ModelShape(params=1_000, cut=None))
    assert planned.ratio is None and "--rank 6 replaces the ratio" in planned.reasons["ratio"]
    assert comera_convert.convert(build("bert"), ratio=8, rank=6).target_ratio is None


def test_the_plan_refuses_what_the_model_or_the_choices_cannot_honour():
    with pytest.raises(ConfigError, match=r"allocation 'learned' learns the rank .*got --modes 2"):
        plan(ConvertRequest(ratio=4, allocation="learned", layout="ttm"), build("bert"))


def test_the_report_stores_the_plan_that_was_carried_out():
    model = build("bert")
    request = ConvertRequest(ratio=3)
    expected = plan(request, build("bert")).describe()
    report = comera_convert.convert(model, request)
    assert report.extra["plan"] == expected
    assert json.loads(report.to_json())["extra"]["plan"] == expected  # plain JSON, no infinity
    assert report.extra["plan"]["d"] == {"value": 1, "reason": expected["d"]["reason"]}


def test_comera_report_prints_the_plan_and_reads_a_report_without_one(tmp_path):
    dense = tmp_path / "dense"
    build("bert-mlm").save_pretrained(dense)
    out = tmp_path / "tt"
    runner = CliRunner(env={"COLUMNS": "200"})
    assert runner.invoke(main, ["convert", str(dense), "--ratio", "3", "--out", str(out)]).exit_code == 0
    shown = runner.invoke(main, ["report", str(out)])
    assert shown.exit_code == 0 and "plan: the options derived for this model" in shown.output
    assert "a codebook table with the tt layout" in shown.output  # the modes' reason
    report = json.loads((out / "comera_report.json").read_text())
    del report["extra"]["plan"]  # a checkpoint written before plans were recorded
    (out / "comera_report.json").write_text(json.dumps(report))
    older = runner.invoke(main, ["report", str(out)])
    assert older.exit_code == 0 and "plan:" not in older.output
