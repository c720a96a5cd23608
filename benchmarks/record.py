"""Benchmark records: one JSON file per published table, under ``benchmarks/results/``.

A record says what was run and where, and holds the figures:

    {
      "name": "quality-minilm",                      # the file's stem
      "title": "all-MiniLM-L6-v2: share of dense recall@1 kept, right after conversion",
      "command": "python benchmarks/quality.py minilm ...",   # reproduces it
      "machine": {"cpu": "AMD EPYC", "cores": 2, "gpu": null},
      "versions": {"torch": "2.13.0+cpu", "transformers": "5.25.0", "comera_convert": "0.1.0"},
      "date": "2026-12-04",
      "columns": [{"key": "label", "header": "model"}, {"key": "english", "header": "english",
                   "format": ".3f"}, ...],
      "rows": [{"label": "--ratio 4", "english": {"value": 0.916, "error": 0.031}, ...}, ...],
      "notes": ["..."]                                # optional: what a reader must know
    }

A cell is a string, a number, null (nothing measured), ``{"value": x, "error": e}`` (a figure and its
standard error) or ``{"value": mean, "error": sd, "runs": [x1, x2, x3]}`` (a figure measured in repeated
runs, their mean and standard deviation: ``runs_cell``; prose may call one route level with or ahead of
another only from such cells, three runs or more of each). ``commit`` names the checkout the figures
were measured on; a new record is made only on a committed tree, so that the commit reproduces it
("+changes" marks older records measured with uncommitted changes). A record copied from the measurement
log that came before the record format has ``source`` instead, naming the commit of that log.
``render.py --check`` refuses a record with neither, and one naming a commit this repository's history
lacks. ``render.py`` turns records into the tables of BENCHMARKS.md, README.md and docs/findings.md.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from comera_convert.machine import cpu_features, cpu_model

RESULTS = Path(__file__).resolve().parent / "results"
REQUIRED = {"name": str, "title": str, "command": str, "machine": dict, "versions": dict, "date": str,
            "columns": list, "rows": list}
REQUIRED_MACHINE = ("cpu", "cores")
COMMIT = re.compile(r"^[0-9a-f]{7,40}(\+changes)?$")
COPIED_AT = re.compile(r"\bat commit ([0-9a-f]{7,40})\b")  # in ``source``: the measurement log's commit
REQUIRED_VERSIONS = ("torch", "transformers")


class RecordError(ValueError):
    """A record that cannot be rendered: the message names the record and what is wrong."""


def machine() -> dict:
    """This machine, as a record states it: CPU model, cores torch uses, its vector features, the GPU."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "cores": torch.get_num_threads(), "features": cpu_features(), "gpu": gpu}


def versions() -> dict:
    import torch
    import transformers

    import comera_convert

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "comera_convert": comera_convert.__version__, "python": platform.python_version()}


def run_command(args: list[str]) -> str:
    """Run a measuring command, echoed on stderr; its standard output, or stop with its error."""
    print("+", shlex.join(args), file=sys.stderr, flush=True)
    done = subprocess.run(args, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {shlex.join(args)} exited with {done.returncode}")
    return done.stdout


def commit() -> str | None:
    """The checkout's commit (with "+changes" when the tree differs from it), or None outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def require_committed_tree() -> str:
    """The checkout's commit, or a RecordError where the tree has uncommitted changes (or is not a git
    checkout): a record's commit must reproduce it. Scripts call it before measuring."""
    found = commit()
    if found is None or found.endswith("+changes"):
        raise RecordError("a record is measured on a committed tree, so that its commit reproduces it: commit "
                          "or stash the changes first (git status lists them)")
    return found


def exit_unless_committed() -> None:
    """Stop a measuring script in one line before it measures anything, where the tree has uncommitted changes."""
    try:
        require_committed_tree()
    except RecordError as err:
        sys.exit(f"error: {err}")


def named_commits(record: dict) -> list[str]:
    """The commits a record names: the checkout it was measured on, or the measurement log it was copied from."""
    found = [record["commit"].removesuffix("+changes")] if record.get("commit") else []
    return found + COPIED_AT.findall(record.get("source") or "")


@functools.cache
def has_full_history(root: Path) -> bool:
    """Whether ``root`` is a git checkout with its whole history (not a shallow clone); read once per root."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=root, capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return shallow == "false"


def check_history(record: dict, root: Path) -> None:
    """Raise RecordError where ``record`` names a commit that ``root``'s git history lacks (nothing is checked
    outside a git checkout or in a shallow clone, whose history is cut)."""
    if not has_full_history(root):
        return
    for named in named_commits(record):
        known = subprocess.run(["git", "cat-file", "-e", f"{named}^{{commit}}"], cwd=root, capture_output=True)
        if known.returncode != 0:
            raise RecordError(f"record {record['name']!r}: commit {named} is not in this repository's history")


# Options whose values a command writes rather than reads: a rerun makes them afresh.
OUTPUT_OPTIONS = frozenset({"--work", "--out", "--results", "--plot", "--json", "--envs"})
# A file a command reads, named by its suffix where the path is relative (an alias such as `minilm` is not).
READ_SUFFIXES = (".jsonl", ".json", ".onnx", ".xml", ".py", ".sh", ".yaml", ".safetensors")
# Records measured from this date on must rerun from a checkout: their commands read only shipped files.
# Older records name files of the machine they were measured on, and their captions say so.
SHIPPED_INPUTS_SINCE = "2026-12-07"


def unshipped_inputs(record: dict, root: Path) -> list[str]:
    """The files ``record``'s command reads that a checkout at ``root`` does not hold: paths outside it
    (absolute, under ``~`` or ``..``) and relative files it lacks. Values of OUTPUT_OPTIONS are written, not
    read, and a record copied from the measurement log (``source``) is not a command to rerun."""
    if record.get("source"):
        return []
    try:
        words = shlex.split(record["command"])
    except ValueError:
        return []
    found, option = [], ""
    for word in words:
        if word.startswith("--"):
            option, _, value = word.partition("=")
            if not value:
                continue
        else:
            value = word
        written, option = option in OUTPUT_OPTIONS, ""
        if written or "/" not in value or any(space in value for space in " \t") or "://" in value:
            continue
        outside = value.startswith(("/", "~", "../"))
        if outside or (value.endswith(READ_SUFFIXES) and not (root / value).exists()):
            found.append(value)
    return found


def held_to_shipped_inputs(record: dict) -> bool:
    """Whether ``record`` was measured when records had to rerun from a checkout (SHIPPED_INPUTS_SINCE)."""
    return record["date"] >= SHIPPED_INPUTS_SINCE


def cell(value: float | None, error: float | None = None) -> dict | float | None:
    """A figure with its standard error where one was measured."""
    if value is None or error is None or error != error:  # NaN: no error could be computed
        return value
    return {"value": value, "error": error}


def runs_cell(values: list[float]) -> dict:
    """A figure measured in repeated runs: their mean and standard deviation, and every run's value (a
    claim that one route is level with or ahead of another rests on three runs or more of each)."""
    values = [float(value) for value in values]
    mean = sum(values) / len(values)
    spread = (sum((value - mean) ** 2 for value in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"value": round(mean, 6), "error": round(spread, 6), "runs": values}


def columns(*specs: tuple) -> list[dict]:
    """Column definitions from ``(key, header)`` or ``(key, header, format)`` tuples; the format is
    Python's (``.3f``) and applies to numbers and their errors."""
    return [{k: v for k, v in zip(("key", "header", "format"), spec) if v is not None} for spec in specs]


def new_record(name: str, title: str, command: str, column_specs: list[tuple], rows: list[dict],
               notes: list[str] = ()) -> dict:
    """A record of figures measured now, on this machine, at this checkout's commit (a tree with uncommitted
    changes is refused)."""
    record = {"name": name, "title": title, "command": command, "machine": machine(), "versions": versions(),
              "date": _dt.datetime.now().date().isoformat(), "commit": require_committed_tree(),
              "columns": columns(*column_specs), "rows": rows, "notes": list(notes)}
    validate(record, name)
    return record


def write(record: dict, results: Path = RESULTS) -> Path:
    """Write ``record`` as ``results/NAME.json``, whole or not at all."""
    path = results / f"{record['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def load(name: str, results: Path = RESULTS) -> dict:
    """The record ``name``, validated."""
    path = results / f"{name}.json"
    if not path.is_file():
        raise RecordError(f"no record {name!r}: expected {path}")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RecordError(f"record {name!r} ({path}) is not valid JSON: {err}") from None
    validate(record, name)
    return record


def validate(record, name: str) -> None:
    """Raise RecordError (naming the record and the field) when ``record`` lacks what a table needs."""
    if not isinstance(record, dict):
        raise RecordError(f"record {name!r}: expected a JSON object, got {type(record).__name__}")
    for field, kind in REQUIRED.items():
        if field not in record:
            raise RecordError(f"record {name!r} has no {field!r} field")
        if not isinstance(record[field], kind):
            raise RecordError(f"record {name!r}: {field!r} should be a {kind.__name__}, "
                              f"got {type(record[field]).__name__}")
    for part, fields in (("machine", REQUIRED_MACHINE), ("versions", REQUIRED_VERSIONS)):
        missing = [field for field in fields if field not in record[part]]
        if missing:
            raise RecordError(f"record {name!r}: {part!r} has no {missing[0]!r}")
    if not record.get("commit") and not record.get("source"):
        raise RecordError(f"record {name!r} has neither 'commit' (the checkout it was measured on) nor 'source' "
                          f"(the measurement log it was copied from)")
    if record.get("commit") is not None and not COMMIT.match(str(record["commit"])):
        raise RecordError(f"record {name!r}: 'commit' should be a git commit hash, got {record['commit']!r}")
    if record.get("source") and not record.get("commit") and not COPIED_AT.search(record["source"]):
        raise RecordError(f"record {name!r}: 'source' should name the commit it was copied at ('... at commit "
                          f"abc1234'), got {record['source']!r}")
    try:
        _dt.date.fromisoformat(record["date"])
    except ValueError:
        raise RecordError(f"record {name!r}: 'date' should read YYYY-MM-DD, got {record['date']!r}") from None
    keys = []
    for column in record["columns"]:
        if not isinstance(column, dict) or "key" not in column or "header" not in column:
            raise RecordError(f"record {name!r}: each column needs a 'key' and a 'header', got {column!r}")
        keys.append(column["key"])
    for index, row in enumerate(record["rows"]):
        if not isinstance(row, dict):
            raise RecordError(f"record {name!r}: row {index + 1} should be an object, got {type(row).__name__}")
        missing = [key for key in keys if key not in row]
        if missing:
            raise RecordError(f"record {name!r}: row {index + 1} has no {missing[0]!r} (write null where "
                              f"nothing was measured)")
        for key in keys:
            _check_cell(row[key], name, index, key)


def _check_cell(value, name: str, index: int, key: str) -> None:
    if value is None or isinstance(value, (str, int, float)):
        return
    numbers = isinstance(value, dict) and all(isinstance(value.get(part), (int, float)) for part in ("value", "error"))
    if numbers and set(value) == {"value", "error"}:
        return
    if numbers and set(value) == {"value", "error", "runs"} and isinstance(value["runs"], list) and all(
            isinstance(run, (int, float)) for run in value["runs"]) and value == runs_cell(value["runs"]):
        return  # the mean and standard deviation are those of the runs
    raise RecordError(f"record {name!r}: row {index + 1}, {key!r} should be a string, a number, null, "
                      f"{{\"value\": x, \"error\": e}} or runs_cell([x1, x2, ...]), got {value!r}")
