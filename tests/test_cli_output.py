"""CLI output that reads anywhere: an 80-column pipe or log file, --json on every command that prints
a table, --quiet, and no progress redraws when the output is not a terminal."""

import json

import pytest
from click.testing import CliRunner

from comera_convert.cli import main

from .tiny_models import build

NARROW = {"COLUMNS": "80"}  # CliRunner's output is not a terminal: a pipe or a log file


def run(*args, env=NARROW):
    return CliRunner(env=env).invoke(main, [str(a) for a in args])


@pytest.fixture
def converted(tmp_path):
    dense = tmp_path / "tiny-bert"
    build("bert-mlm").save_pretrained(dense)
    (dense / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    out = tmp_path / "tiny-tt3"
    result = run("convert", dense, "--ratio", "3", "--out", out)
    assert result.exit_code == 0, result.output
    return dense, out, result.output


def lines_fit(output: str, width: int = 80) -> bool:
    return all(len(line.rstrip()) <= width for line in output.splitlines())


def test_tables_in_an_80_column_pipe_keep_every_cell_whole(converted):
    _, out, convert_output = converted
    names = [row["name"] for row in json.loads(run("report", out, "--json").output)["report"]["modules"]]
    assert "…" not in convert_output  # its messages are single lines the terminal wraps (soft wrap)
    for output in (run("report", out).output, run("report", out, "--by-module").output):
        assert "…" not in output and lines_fit(output)
    by_module = run("report", out, "--by-module").output
    assert all(name in by_module for name in names)  # full module names, never cut
    assert "dense=" in by_module  # too wide for a table: one record per module
    wide = run("report", out, "--by-module", env={"COLUMNS": "200"}).output
    assert "dense=" not in wide and all(name in wide for name in names)  # a table where it fits


def test_compare_states_licence_method_and_commands_side_by_side(converted):
    dense, out, _ = converted
    output = run("report", dense, out, "--compare").output
    assert lines_fit(output) and "…" not in output
    for label in ("licence", "method", "made by", "ratio vs tiny-bert"):
        assert label in output
    assert output.count("mit") >= 2 and "comera convert" in output


@pytest.mark.parametrize("command", ["convert", "report"])
def test_json_output_parses(converted, tmp_path, command):
    dense, out, _ = converted
    args = ([command, dense, "--ratio", "3", "--out", tmp_path / "again"] if command == "convert"
            else [command, out])
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    report = payload["report"]
    assert report["ratio"] >= 3 and report["modules"]


def test_quiet_prints_nothing_but_errors_and_json(converted, tmp_path):
    dense, out, _ = converted
    result = run("--quiet", "convert", dense, "--ratio", "3", "--out", tmp_path / "q")
    assert result.exit_code == 0 and result.output == ""
    assert (tmp_path / "q" / "model.safetensors").is_file()
    assert json.loads(run("-q", "report", out, "--json").output)["compressed"]
    failed = run("-q", "convert", dense, "--ratio", "3", "--out", tmp_path / "q")
    assert failed.exit_code == 1 and "not empty" in failed.output


def test_no_progress_redraws_outside_a_terminal(converted):
    _, _, output = converted
    assert "converting" not in output and "loading" not in output


def test_sizes_are_printed_in_the_binary_units_they_are_computed_in(converted):
    _, out, _ = converted
    output = run("report", out, env={"COLUMNS": "200"}).output
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    kib = f"{weights / 1024:.1f} KiB"  # the tiny checkpoint is between 1 KiB and 1 MiB
    assert kib in output, (kib, output)
    assert " KB" not in output and " MB" not in output


def test_a_conversion_lists_its_stages_seconds_in_the_order_they_run():
    from comera_convert.cli.commands import _stage_seconds

    timings = {"save": 1.0, "custom": 2.0, "reconstruct": 4.0, "load": 0.5, "convert": 3.0}
    assert _stage_seconds(timings) == "load 0.5 s, reconstruct 4.0 s, convert 3.0 s, save 1.0 s, custom 2.0 s"
