"""Benchmark records and the tables written from them (benchmarks/): every published table matches its
record, a changed figure or a table with no record fails the check in one line naming it, and the
scripts turn what `comera frontier` and `comera bench` report into records."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"


def script(name: str):
    """A module of benchmarks/ (they are scripts, not a package)."""
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = script("render")
record = script("record")


def a_checkout(tmp_path: Path) -> Path:
    """The documents and records of the repository, copied, to change without touching it."""
    root = tmp_path / "repo"
    shutil.copytree(BENCHMARKS / "results", root / "benchmarks" / "results")
    for script_file in BENCHMARKS.glob("*.py"):  # the scripts records name
        shutil.copy(script_file, root / "benchmarks" / script_file.name)
    shutil.copytree(REPO / "docs", root / "docs")
    for name in ("BENCHMARKS.md", "README.md"):
        shutil.copy(REPO / name, root / name)
    return root


def test_every_published_table_matches_its_record(capsys):
    assert render.main(["--check"]) == 0, capsys.readouterr().err


def test_every_record_is_complete_and_rendered_somewhere():
    text = "\n".join(path.read_text() for path in render.documents(REPO) if path.is_file())
    for path in sorted((BENCHMARKS / "results").glob("*.json")):
        loaded = record.load(path.stem)
        assert loaded["name"] == path.stem
        assert f"<!-- record: {path.stem}" in text, f"{path.name} is published nowhere"


def test_a_changed_figure_fails_the_check_naming_its_record(tmp_path, capsys):
    root = a_checkout(tmp_path)
    path = root / "benchmarks" / "results" / "serving-mpnet.json"
    data = json.loads(path.read_text())
    data["rows"][3]["sps"] = data["rows"][3]["sps"] + 1.0
    path.write_text(json.dumps(data))
    assert render.main(["--check", "--root", str(root)]) == 1
    error = capsys.readouterr().err
    assert "the table of record 'serving-mpnet' differs from the record" in error
    assert render.main(["--root", str(root)]) == 0  # written afresh, the check passes again
    assert render.main(["--check", "--root", str(root)]) == 0
    assert f"| {data['rows'][3]['sps']} |" in (root / "BENCHMARKS.md").read_text()


def test_a_record_missing_a_field_is_one_line_naming_it(tmp_path, capsys):
    root = a_checkout(tmp_path)
    path = root / "benchmarks" / "results" / "fsdp-memory.json"
    data = json.loads(path.read_text())
    del data["machine"]["cpu"]
    path.write_text(json.dumps(data))
    assert render.main(["--check", "--root", str(root)]) == 2
    assert capsys.readouterr().err == "error: record 'fsdp-memory': 'machine' has no 'cpu'\n"
    del data["date"]
    path.write_text(json.dumps(data))
    assert render.main(["--check", "--root", str(root)]) == 2
    assert capsys.readouterr().err == "error: record 'fsdp-memory' has no 'date' field\n"


def test_a_table_with_no_record_behind_it_fails_naming_the_line(tmp_path, capsys):
    root = a_checkout(tmp_path)
    text = (root / "BENCHMARKS.md").read_text()
    (root / "BENCHMARKS.md").write_text(text + "\n| model | kept |\n|---|---|\n| a | 0.93 |\n")
    assert render.main(["--check", "--root", str(root)]) == 1
    line = len(text.split("\n")) + 1
    assert f"BENCHMARKS.md line {line}: a table of figures with no record behind it" in capsys.readouterr().err
    readme = (root / "README.md").read_text()
    (root / "README.md").write_text(readme + "\n| job | route |\n|---|---|\n| serve | convert |\n")
    (root / "BENCHMARKS.md").write_text(text)
    assert render.main(["--check", "--root", str(root)]) == 0  # the README may hold tables without figures


def test_a_figure_in_prose_without_a_record_fails_naming_its_line(tmp_path, capsys):
    root = a_checkout(tmp_path)
    text = (root / "docs" / "speed.md").read_text()
    line = len(text.split("\n")) + 1
    for figure in ("0.93", "1.4x", "2.5 GiB", "12 s"):
        (root / "docs" / "speed.md").write_text(text + f"\nThe route keeps {figure} here.\n")
        assert render.main(["--check", "--root", str(root)]) == 1
        error = capsys.readouterr().err
        assert error.startswith(f"error: speed.md line {line}: the figure {figure!r} is in no record"), error
    # settings as code, whole-number counts and versions are not figures
    (root / "docs" / "speed.md").write_text(text + "\nRun `--ratio 2.5` for 30 minutes at 4x with torch 2.13.0 "
                                            "and transformers 5.19, over 5 % of the stage.\n")
    assert render.main(["--check", "--root", str(root)]) == 0, capsys.readouterr().err


def test_a_value_reference_shows_its_record_cell_and_fails_the_check_when_it_differs(tmp_path, capsys):
    root = a_checkout(tmp_path)
    reference = "<!-- value: quality-minilm label='--ratio 4' english -->{}<!-- /value -->"
    text = (root / "docs" / "speed.md").read_text()
    (root / "docs" / "speed.md").write_text(text + "\nIt keeps " + reference.format("0.5") + " of it.\n")
    assert render.main(["--check", "--root", str(root)]) == 1
    assert "the table of record 'quality-minilm' differs from the record" in capsys.readouterr().err
    assert render.main(["--root", str(root)]) == 0
    kept = record.load("quality-minilm")["rows"]
    cell = next(row["english"] for row in kept if row["label"] == "--ratio 4")
    shown = render.format_cell(cell, ".3f")
    assert reference.format(shown) in (root / "docs" / "speed.md").read_text()
    assert render.main(["--check", "--root", str(root)]) == 0


@pytest.mark.parametrize("spec, message", [
    ("quality-minilm label='--ratio 99' english", "record 'quality-minilm' has 0 rows with label='--ratio 99'"),
    ("quality-minilm english", "rows with no selector (a reference cites one)"),
    ("quality-minilm label='--ratio 4' speed", "record 'quality-minilm' has no column 'speed'"),
    ("quality-minilm label='--ratio 4'", "names no column"),
])
def test_a_value_reference_that_picks_no_single_cell_is_one_line(tmp_path, capsys, spec, message):
    root = a_checkout(tmp_path)
    (root / "docs" / "extra.md").write_text(f"A <!-- value: {spec} -->0.9<!-- /value --> share.\n")
    assert render.main(["--check", "--root", str(root)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: extra.md line 1: ") and message in error and error.count("\n") == 1, error


def a_record_of_runs(root: Path, monkeypatch, speeds: dict) -> None:
    """A record of the speeds of routes over repeated runs, in ``root``'s results."""
    monkeypatch.setattr(record, "commit", lambda: "abc1234")
    rows = [{"route": route, "speed": record.runs_cell(values)} for route, values in speeds.items()]
    made = record.new_record("trial-runs", "routes over runs", "python benchmarks/bench.py",
                             [("route", "route"), ("speed", "speed", ".2f")], rows)
    record.write(made, root / "benchmarks" / "results")


@pytest.mark.parametrize("speeds, word", [
    ({"a": [2.0, 2.1, 2.2], "b": [2.05, 2.15, 2.3]}, "level with"),
    ({"a": [3.0, 3.1, 3.2], "b": [2.0, 2.1, 2.2]}, "ahead of"),
    ({"a": [1.0, 1.1, 1.2], "b": [2.0, 2.1, 2.2]}, "behind"),
])
def test_a_comparison_takes_its_word_from_three_runs_of_each_route(tmp_path, capsys, monkeypatch, speeds, word):
    root = a_checkout(tmp_path)
    a_record_of_runs(root, monkeypatch, speeds)
    comparison = "<!-- compare: trial-runs route=a speed vs route=b speed -->{}<!-- /compare -->"
    (root / "docs" / "extra.md").write_text("Route a runs " + comparison.format("faster than") + " route b.\n")
    assert render.main(["--check", "--root", str(root)]) == 1
    assert "the table of record 'trial-runs' differs from the record" in capsys.readouterr().err
    assert render.main(["--root", str(root)]) == 0
    assert comparison.format(word) in (root / "docs" / "extra.md").read_text()
    assert render.format_cell(record.runs_cell(speeds["a"]), ".2f") == (
        f"{sum(speeds['a']) / 3:.2f} ± {record.runs_cell(speeds['a'])['error']:.2f}")  # mean ± sd


def test_a_comparison_on_fewer_than_three_runs_is_refused(tmp_path, capsys, monkeypatch):
    root = a_checkout(tmp_path)
    a_record_of_runs(root, monkeypatch, {"a": [3.0, 3.1], "b": [2.0, 2.1, 2.2]})
    (root / "docs" / "extra.md").write_text("a <!-- compare: trial-runs route=a speed vs route=b speed -->"
                                            "ahead of<!-- /compare --> b\n")
    assert render.main(["--check", "--root", str(root)]) == 2
    assert capsys.readouterr().err == (
        "error: extra.md line 1: record 'trial-runs': 'speed' of route='a' rests on 2 run(s); a claim of level "
        "or ahead needs 3 or more of each route\n")


def test_ranking_words_in_prose_need_a_comparison(tmp_path, capsys):
    root = a_checkout(tmp_path)
    text = (root / "docs" / "speed.md").read_text()
    line = len(text.split("\n")) + 1
    (root / "docs" / "speed.md").write_text(text + "\nThe int8 graph runs ahead of the peer; the float one draws\n"
                                            "level with it.\n")
    assert render.main(["--check", "--root", str(root)]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert [error.split(": ", 2)[1:] for error in errors] == [
        [f"speed.md line {line}", "'ahead of' ranks two routes without their runs (derive it with <!-- compare: "
         "RECORD KEY=VALUE COLUMN vs KEY=VALUE COLUMN --> from 3 runs of each, or state the figures)"],
        [f"speed.md line {line}", errors[1].split(": ", 2)[2]]]
    assert "'draws\nlevel'" not in errors[1] and "draws" in errors[1]


def test_ranking_words_in_a_hand_written_table_need_a_comparison(tmp_path, capsys):
    root = a_checkout(tmp_path)
    text = (root / "docs" / "jobs.md").read_text()
    row = len(text.split("\n")) + 3  # after a blank line, the header and its rule
    (root / "docs" / "jobs.md").write_text(text + "\n| route | speed |\n|---|---|\n| int8 graph | ahead of dense |\n")
    assert render.main(["--check", "--root", str(root)]) == 1
    assert capsys.readouterr().err.startswith(f"error: jobs.md line {row}: 'ahead of' ranks two routes")


def test_a_block_naming_a_missing_record_or_column_is_refused(tmp_path, capsys):
    root = a_checkout(tmp_path)
    (root / "docs" / "extra.md").write_text("<!-- record: no-such-record -->\n<!-- /record -->\n")
    assert render.main(["--check", "--root", str(root)]) == 2
    assert "no record 'no-such-record'" in capsys.readouterr().err
    (root / "docs" / "extra.md").write_text("<!-- record: fsdp-memory columns=model,speed -->\n<!-- /record -->\n")
    assert render.main(["--check", "--root", str(root)]) == 2
    assert "record 'fsdp-memory' has no column 'speed'" in capsys.readouterr().err
    (root / "docs" / "extra.md").write_text("<!-- record: fsdp-memory -->\n")
    assert render.main(["--check", "--root", str(root)]) == 2
    assert "extra.md line 1: the record block has no closing <!-- /record -->" in capsys.readouterr().err


def test_a_table_states_its_machine_date_and_command():
    loaded = record.load("serving-mpnet")
    lines = render.render_table(loaded, {})
    assert lines[0].startswith("| method |") and len([line for line in lines if line.startswith("|")]) == 6
    assert "0.940 ± 0.043" in lines[5]
    caption = lines[-1]
    assert loaded["date"] in caption and "Intel Xeon, 2 cores" in caption and loaded["command"] in caption
    assert "torch 2.13.0+cpu" in caption and "benchmarks/results/serving-mpnet.json" in caption


def test_a_block_keeps_the_rows_whose_key_is_any_of_its_values():
    loaded = record.load("serving-frontier-minilm")
    picked = "None|ratio-2"
    lines = render.render_table(loaded, {"rows": f"checkpoint:{picked}", "columns": "method,checkpoint"})
    shown = [line for line in lines[2:] if line.startswith("|")]
    expected = [row for row in loaded["rows"] if str(row["checkpoint"]) in picked.split("|")]
    assert len(shown) == len(expected) and 0 < len(expected) < len(loaded["rows"])
    assert all(line.endswith("|  |") or line.endswith("| ratio-2 |") for line in shown)
    with pytest.raises(render.RecordError, match="no row with checkpoint = 'ratio-9' or 'ratio-10'"):
        render.render_table(loaded, {"rows": "checkpoint:ratio-9|ratio-10"})


def test_cells_read_as_the_columns_say():
    assert render.format_cell({"value": 0.9, "error": 0.031}, ".3f") == "0.900 ± 0.031"
    assert render.format_cell(None) == "" and render.format_cell("--ratio 4") == "`--ratio 4`"
    assert render.format_cell("`--ratio 4`, then the recipe") == "`--ratio 4`, then the recipe"
    assert render.format_cell("a | b") == "a \\| b"
    # a figure measured over runs, with no column format, reads to its spread's second significant digit
    assert render.format_cell({"value": 1.243333, "error": 0.081445, "runs": [1.2, 1.2, 1.3]}) == "1.243 ± 0.081"
    assert render.format_cell({"value": 118.2333, "error": 3.1}) == "118.2 ± 3.1"
    assert render.format_cell({"value": 1.0, "error": 0.0}) == "1.000 ± 0.000"


def test_a_record_names_the_commit_it_was_measured_on_and_the_history_holds_it(tmp_path, capsys):
    root = a_checkout(tmp_path)
    path = root / "benchmarks" / "results" / "attention-units-minilm.json"
    data = json.loads(path.read_text())
    measured_at = data["commit"]
    assert f"commit {measured_at}" in render.render_table(data, {})[-1]  # the caption names it
    del data["commit"]
    path.write_text(json.dumps(data))
    assert render.main(["--check", "--root", str(root)]) == 2
    assert capsys.readouterr().err == ("error: record 'attention-units-minilm' has neither 'commit' (the checkout "
                                       "it was measured on) nor 'source' (the measurement log it was copied from)\n")
    path.write_text(json.dumps({**data, "commit": "not a commit"}))
    assert render.main(["--check", "--root", str(root)]) == 2
    assert "'commit' should be a git commit hash, got 'not a commit'" in capsys.readouterr().err
    if not record.has_full_history(REPO):
        pytest.skip("the history is checked in a full git clone only")
    unknown = {**data, "commit": "0123abc"}  # a well-formed hash that the history lacks
    with pytest.raises(record.RecordError, match="commit 0123abc is not in this repository's history"):
        record.check_history(unknown, REPO)
    record.check_history({**data, "commit": measured_at}, REPO)
    copied = {**data, "source": "copied from the measurement log (BENCHMARKS.md at commit 0123abd)"}
    with pytest.raises(record.RecordError, match="commit 0123abd is not in this repository's history"):
        record.check_history(copied, REPO)


def test_the_files_a_command_reads_are_shipped_or_named():
    command = ("python benchmarks/serving_frontier.py minilm --work /tmp/w --plot docs/images/f.png "
               "--json=/tmp/out.json --pairs /tmp/man.jsonl --pairs=/tmp/debian.jsonl --checkpoint ~/tt4 "
               "--peer ../peers/model.onnx --run '4 => --recipe x' --texts 256 tools/build_heldout_pairs.py "
               "--pairs pairs/missing.jsonl sentence-transformers/all-MiniLM-L6-v2")
    measured = {"command": command}
    assert record.unshipped_inputs(measured, REPO) == [
        "/tmp/man.jsonl", "/tmp/debian.jsonl", "~/tt4", "../peers/model.onnx", "pairs/missing.jsonl"]
    copied = {**measured, "source": "copied from the measurement log (BENCHMARKS.md at commit 23f1122)"}
    assert record.unshipped_inputs(copied, REPO) == []  # a log's line, not a command to rerun


def test_a_record_reading_files_that_do_not_ship_fails_the_check_from_its_date(tmp_path, capsys):
    root = a_checkout(tmp_path)
    path = root / "benchmarks" / "results" / "attention-units-minilm.json"
    data = json.loads(path.read_text())
    data["command"] += " --pairs /tmp/man.jsonl --work /tmp/units"
    path.write_text(json.dumps({**data, "date": record.SHIPPED_INPUTS_SINCE}))
    render.main(["--root", str(root)])  # the table follows its record; the input stays unshipped
    capsys.readouterr()
    assert render.main(["--check", "--root", str(root)]) == 1
    assert capsys.readouterr().err == (
        "error: benchmarks/results/attention-units-minilm.json: the command reads /tmp/man.jsonl, which a "
        "checkout does not hold: make inputs with a shipped script under --work, or ship them\n")
    path.write_text(json.dumps({**data, "date": "2026-12-05"}))  # measured before records had to rerun
    assert render.main(["--root", str(root)]) == 0
    assert render.main(["--check", "--root", str(root)]) == 0
    assert "it read files that do not ship (/tmp/man.jsonl), so it does not rerun" in render.render_table(data, {})[-1]


def test_each_finding_cites_where_its_figures_are():
    # A finding's log names the commit whose BENCHMARKS.md or change holds its figures, or the record that does.
    if not record.has_full_history(REPO):
        pytest.skip("the history is read in a full git clone only")
    decimal = re.compile(r"\d+\.\d+")
    untraced = []
    for row in record.load("findings")["rows"]:
        figures = set(decimal.findall(re.sub(r"`[^`]*`", " ", row["measured"])))
        cited = re.fullmatch(r"record `(?P<name>[\w-]+)`|`(?P<commit>[0-9a-f]{7,40})`", row["log"])
        assert cited, f"{row['finding']!r}: the log {row['log']!r} names neither a commit nor a record"
        if cited["name"]:
            source = json.dumps(record.load(cited["name"]))
        else:
            source = "".join(subprocess.run(["git", "show", what], cwd=REPO, capture_output=True, text=True).stdout
                             for what in (f"{cited['commit']}:BENCHMARKS.md", cited["commit"]))
        if figures and not any(figure in source for figure in figures):
            untraced.append(f"{row['finding']!r}: none of {sorted(figures)} in {row['log']}")
    assert untraced == []


def test_a_new_record_is_refused_on_a_tree_with_uncommitted_changes(monkeypatch):
    monkeypatch.setattr(record, "commit", lambda: "abc1234+changes")
    with pytest.raises(record.RecordError, match="a record is measured on a committed tree"):
        record.new_record("trial", "a trial", "python benchmarks/x.py", [("label", "model")], [{"label": "x"}])
    with pytest.raises(SystemExit, match="^error: a record is measured on a committed tree"):
        record.exit_unless_committed()


def test_a_new_record_states_this_machine_and_validates(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "commit", lambda: "abc1234")  # as on a committed tree
    made = record.new_record("trial", "a trial", "python benchmarks/x.py",
                             [("label", "model"), ("kept", "kept", ".3f")],
                             [{"label": "--ratio 4", "kept": record.cell(0.9, 0.02)}])
    assert made["machine"]["cores"] >= 1 and made["machine"]["cpu"] and made["versions"]["torch"]
    written = record.write(made, tmp_path)
    assert json.loads(written.read_text())["rows"][0]["kept"] == {"value": 0.9, "error": 0.02}
    assert record.cell(0.9, float("nan")) == 0.9  # no error could be computed: the figure alone
    with pytest.raises(record.RecordError, match="row 1 has no 'kept'"):
        record.validate({**made, "rows": [{"label": "x"}]}, "trial")
    with pytest.raises(record.RecordError, match="'date' should read YYYY-MM-DD"):
        record.validate({**made, "date": "yesterday"}, "trial")


def test_the_frontier_script_keeps_each_speed_over_its_runs():
    frontier = script("serving_frontier")
    kept = {"value": 0.97, "error": 0.03}

    def bench_rows(comera: float, peer: float, also: bool = True) -> list[dict]:
        rows = [{"method": "comera, OpenVINO int8 [ratio-4]", "speed_vs_peer": comera, "kept_english": kept},
                {"method": "peer: openvino_model_qint8_quantized.xml", "speed_vs_peer": peer, "kept_english": kept}]
        return rows + ([{"method": "comera float32 [ratio-4]", "speed_vs_peer": 0.7}] if also else [])

    merged = frontier.merged_runs([bench_rows(1.3, 1.0), bench_rows(1.1, 1.0, also=False), bench_rows(1.2, 1.0)])
    assert [row["method"] for row in merged] == ["comera, OpenVINO int8 [ratio-4]",
                                                 "peer: openvino_model_qint8_quantized.xml"]  # in every run only
    ours, peer = merged
    assert ours["speed_vs_peer"] == record.runs_cell([1.3, 1.1, 1.2])  # mean, spread and every run
    assert ours["kept_english"] == kept  # the shares kept are the first run's
    assert render.comparison_word({"name": "f", "rows": merged}, ({"method": ours["method"]}, "speed_vs_peer"),
                                  ({"method": peer["method"]}, "speed_vs_peer")) == "ahead of"


def test_the_quality_script_turns_a_frontier_into_rows():
    quality = script("quality")
    frontier = {"dense_bytes": 4 * 2 ** 20, "domains": ["english", "man"], "notes": [], "points": [
        {"label": "/w/ratio-4", "kind": "comera", "bytes": 2 ** 20, "kept": {"english": 0.9, "man": 0.8},
         "kept_error": {"english": 0.03, "man": float("nan")}, "mean_kept": 0.85, "mean_kept_error": 0.02},
        {"label": "int8, a scale per row", "kind": "peer", "bytes": 2 ** 20, "kept": {"english": 1.0, "man": 1.0},
         "kept_error": {"english": 0.0, "man": 0.0}, "mean_kept": 1.0, "mean_kept_error": 0.0}]}
    rows = quality.rows_of(frontier, {"/w/ratio-4": "--ratio 4"}, {"/w/ratio-4": 61.4})
    assert rows[0] == {"label": "--ratio 4", "kind": "comera", "mib": 1.0, "fewer": 4.0,
                       "english": {"value": 0.9, "error": 0.03}, "man": 0.8,
                       "mean": {"value": 0.85, "error": 0.02}, "seconds": 61}
    assert rows[1]["label"] == "int8, a scale per row (peer)" and rows[1]["seconds"] is None
    assert [key for key, *_ in quality.columns_of(frontier["domains"])] == [
        "label", "mib", "fewer", "english", "man", "mean", "seconds"]


def test_the_bench_script_keeps_each_share_with_its_error():
    bench = script("bench")
    row = {"case": "inference", "method": "comera int8 compute", "device": "cpu", "dtype": "float32",
           "shape": "400 texts", "sentences_per_s": 163.1, "speed_vs_dense": 3.3, "ranks": [1, 2],
           "recall_kept": {"english": 0.991, "man": 0.956}, "recall_kept_error": {"english": 0.025, "man": 0.02}}
    cells = bench.flatten(row)
    assert cells == {"method": "comera int8 compute", "shape": "400 texts", "sentences_per_s": 163.1,
                     "speed_vs_dense": 3.3, "ranks": "1,2", "kept_english": {"value": 0.991, "error": 0.025},
                     "kept_man": {"value": 0.956, "error": 0.02}}
    assert ("kept_man", "man kept", ".3f") in bench.columns_of(list(cells))


def test_the_side_by_side_script_reads_each_run_and_its_last_quarter(tmp_path):
    side_by_side = script("side_by_side")
    assert side_by_side.split_run("--ratio 2 => --recipe r --target-ratio 4") == ("--ratio 2",
                                                                                 "--recipe r --target-ratio 4")
    with pytest.raises(SystemExit, match="'CONVERT OPTIONS => TRAIN OPTIONS', got '--ratio 2'"):
        side_by_side.split_run("--ratio 2")
    # 40 steps, the first 30 at 1 s, the last quarter at 0.5 s a step.
    history = [{"step": s, "seconds": float(min(s, 30)) + 0.5 * max(0, s - 30), "ratio": 4.0} for s in range(1, 41)]
    assert side_by_side.last_quarter_step_seconds(history) == pytest.approx(0.5)
    assert side_by_side.last_quarter_step_seconds(history[:5]) is None  # too short to have a last quarter
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "comera_report.json").write_text(json.dumps({"extra": {"training": {
        "steps": 40, "held_out_loss_after": 0.31234, "ratio_reached": 4.0123}}}))
    (trained / "comera_history.json").write_text(json.dumps(history))
    point = {"bytes": 2 ** 20, "kept": {"english": 0.97}, "kept_error": {"english": 0.02}, "mean_kept": 0.97,
             "mean_kept_error": 0.02}
    row = side_by_side.row_of("a run", trained, point, {"dense_bytes": 4 * 2 ** 20, "domains": ["english"]})
    assert row == {"label": "a run", "steps": 40, "loss": 0.312, "ratio": 4.01, "fewer": 4.0, "step_seconds": 0.5,
                   "english": {"value": 0.97, "error": 0.02}, "mean": {"value": 0.97, "error": 0.02}}


def test_the_attention_units_script_closes_heads_and_ranks_to_the_parameters_it_reports():
    torch = pytest.importorskip("torch")
    from transformers import BertConfig, BertModel

    units = script("attention_units")
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = BertModel(config).eval()
    batches = [{"input_ids": torch.randint(0, 50, (4, 12)), "attention_mask": torch.ones(4, 12, dtype=torch.long)}]
    total = units.attention_parameters(model)
    found = units.grams(model, batches)
    svds = {(i, name): units.whitened_svd(linear.weight, found[(i, "output" if name == "output" else "input")])
            for i, block in enumerate(units.attention_blocks(model)) for name, linear in units.linears(block).items()}
    query = model.encoder.layer[0].attention.self.query
    full = units.whitened_svd(query.weight, found[(0, "input")])
    rebuilt = (full[0] * full[1]) @ full[2] @ full[3]
    assert torch.allclose(rebuilt.float(), query.weight, atol=1e-4)  # all ranks kept: the weight itself

    ranked = BertModel(config).eval()
    ranked.load_state_dict(model.state_dict())
    held = units.compress_ranks(ranked, svds, 0.25, uniform=False)
    assert held <= 0.25 * total
    assert torch.linalg.matrix_rank(ranked.encoder.layer[0].attention.self.query.weight) < 32

    importance = {(i, h): float(4 * i + h) for i in range(2) for h in range(4)}  # head (0, 0) matters least
    headless = BertModel(config).eval()
    headless.load_state_dict(model.state_dict())
    held = units.compress_heads(headless, importance, 0.75, uniform=False)
    assert held == total - 2 * units.head_parameters(model)
    output = headless.encoder.layer[0].attention.output.dense.weight
    assert output[:, :8].abs().sum() == 0 and output[:, 8:].abs().sum() > 0  # head 0 of 8 columns closed
