"""The conversion's stages (``pipeline/stages/``), run by one runner (``pipeline/runner.py``): each stage's
lifecycle runs in order around the converter's module loop, a stage is added by one line in ``STAGES``, each
step is timed as its stage's without counting a second time in the loop's seconds, and what a stage opened is
released however the conversion ends."""

import time

import pytest

from comera_convert.api import convert_checkpoint
from comera_convert.conversion import ConvertOptions
from comera_convert.pipeline import run
from comera_convert.pipeline.runner import CONVERT, Stage, StageClock

from . import behaviour
from .tiny_models import build


def recording(sleep_in: str | None = None, here: bool = True):
    """A stage class whose instances write down each step they are given into its ``steps``, and sleep in one
    step so that its seconds show."""

    class Recorded(Recording):
        name = "recording" if here else "not-here"
        steps: list = []

        def __init__(self):
            self.sleep_in = sleep_in

        def applies(self, job):
            return here

    return Recorded


class Recording(Stage):
    steps: list
    sleep_in: str | None

    def _step(self, what: str, *name) -> None:
        self.steps.append((what, *name))
        if what == self.sleep_in:
            time.sleep(0.05)

    def prepare(self, job):
        self._step("prepare")

    def before_module(self, job, name):
        self._step("before", name)

    def after_module(self, job, name):
        self._step("after", name)

    def per_block(self, job, block):
        self._step("block", block.index)

    def finish(self, job):
        self._step("finish")


def _with_stages(monkeypatch, *extra):
    monkeypatch.setattr(run, "STAGES", run.STAGES + extra)


def test_a_stage_added_to_the_list_runs_its_lifecycle_around_each_streamed_module(tmp_path, monkeypatch):
    build("llama-clm").save_pretrained(tmp_path / "dense")
    added, skipped = recording(), recording(here=False)
    _with_stages(monkeypatch, added, skipped)
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    converted = sorted(m.name for m in result.report.modules if m.kind != "tied_head")
    assert added.steps[0] == ("prepare",) and added.steps[-1] == ("finish",)
    modules = added.steps[1:-1]
    for step in ("before", "after"):
        assert sorted(name for what, name in modules if what == step) == converted
    assert all(modules.index(("before", name)) < modules.index(("after", name)) for name in converted)
    assert skipped.steps == [] and "not-here" not in result.timings and "recording" in result.timings


def test_a_model_in_memory_gives_the_stages_no_module_steps(tmp_path, monkeypatch):
    """A source that does not stream (here: a repo id resolved to a folder loaded whole) has no module steps."""
    from comera_convert.pipeline import sources

    build("bert-mlm").save_pretrained(tmp_path / "dense")
    monkeypatch.setattr(sources, "streams", lambda path, request: False)
    monkeypatch.setattr(run, "streams", lambda path, request: False)
    added = recording()
    _with_stages(monkeypatch, added)
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert added.steps == [("prepare",), ("finish",)] and "streamed" not in result.report.extra


def test_each_step_counts_once_in_the_timings(tmp_path, monkeypatch):
    """A module step runs inside the module loop: its seconds are its stage's and leave the loop's, so the
    timings add up to no more than the conversion's wall time."""
    dense, _ = behaviour.dense_source(tmp_path)
    added = recording(sleep_in="before")
    _with_stages(monkeypatch, added)
    options = ConvertOptions(reconstruct_steps=3, **behaviour.BLOCKS)  # the blocks converted, then tuned
    began = time.perf_counter()
    result = convert_checkpoint(str(dense), tmp_path / "tt", options)
    wall = time.perf_counter() - began
    modules = sum(step[0] == "before" for step in added.steps)
    assert result.report.extra["streamed"] and set(result.timings) == {"load", "calibrate", "reconstruct", CONVERT,
                                                                        "save", "recording"}
    blocks = [step[1] for step in added.steps if step[0] == "block"]
    assert blocks == [0, 1] == [fit["block"] for fit in result.report.extra["reconstruction"]]
    assert result.timings["recording"] >= 0.05 * modules
    assert all(seconds >= 0 for seconds in result.timings.values())
    assert sum(result.timings.values()) <= wall


def test_the_clock_charges_a_nested_stage_to_itself_alone():
    clock = StageClock()
    with clock.stage("outer"):
        time.sleep(0.02)
        with clock.stage("inner"):
            time.sleep(0.05)
    assert clock.seconds["inner"] >= 0.05 and 0.02 <= clock.seconds["outer"] < 0.05


def test_a_failing_stage_leaves_no_spool_and_no_output(tmp_path, monkeypatch):
    build("llama-clm").save_pretrained(tmp_path / "dense")

    class Failing(Stage):
        name = "failing"

        def after_module(self, job, name):
            raise RuntimeError(f"stopped after {name}")

    _with_stages(monkeypatch, Failing)
    with pytest.raises(RuntimeError, match="stopped after"):
        convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]
