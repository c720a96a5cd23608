"""Speed and memory: run `comera bench` and keep its rows as a record.

    python benchmarks/bench.py --name cpu-train-step -- train-step
    python benchmarks/bench.py --name serving-mytask --title "..." -- inference \
        --checkpoint minilm-tt4-trained --pairs man.jsonl --pairs debian.jsonl --texts 400

Everything after ``--`` is passed to `comera bench` (cases and options). Each row of its JSON
becomes a row of the record: the method, the shape, every figure it reports; the share of dense
recall@1 kept per domain (inference with ``--checkpoint``) as a figure with its standard error.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record as records  # noqa: E402

SKIPPED = ("case", "device", "dtype")  # said once, in the title and the machine
HEADERS = {"method": "method", "shape": "shape", "batch": "batch", "ms": "ms", "tokens_per_s": "tokens/s",
           "peak_mb": "peak MB", "speedup": "vs dense", "speed_vs_dense": "vs dense",
           "memory_vs_dense": "memory vs dense", "sentences_per_s": "sentences/s", "params_ratio": "params ratio",
           "flop_ratio": "FLOP ratio", "file_mb": "file MB"}


def flatten(row: dict) -> dict:
    """A bench row as record cells: lists joined, shares kept split into one figure per domain."""
    cells = {}
    for key, value in row.items():
        if key in SKIPPED or key == "recall_kept_error":
            continue
        if key == "recall_kept":
            errors = row.get("recall_kept_error", {})
            cells.update({f"kept_{domain}": records.cell(share, errors.get(domain)) for domain, share in value.items()})
        elif isinstance(value, list):
            cells[key] = ",".join(str(item) for item in value)
        else:
            cells[key] = value
    return cells


def columns_of(keys: list[str]) -> list[tuple]:
    """A column per cell key; the shares kept by domain read as figures of three decimals."""
    return [(key, f"{key.removeprefix('kept_')} kept" if key.startswith("kept_") else HEADERS.get(key, key),
             ".3f" if key.startswith("kept_") else None) for key in keys]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="the record's name: benchmarks/results/NAME.json")
    parser.add_argument("--title", default=None)
    parser.add_argument("--results", type=Path, default=records.RESULTS, help="where the record is written")
    args = parser.parse_args(argv[:split])
    records.exit_unless_committed()  # the record's commit must reproduce it
    bench_args = argv[split + 1:]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        records.run_command(["comera", "--quiet", "bench", *bench_args, "--json", str(out)])
        result = json.loads(out.read_text())
    rows = [flatten(row) for row in result["rows"]]
    keys = list(dict.fromkeys(key for row in rows for key in row))
    rows = [{key: row.get(key) for key in keys} for row in rows]
    cases = sorted({row["case"] for row in result["rows"]})
    title = args.title or f"`comera bench {' '.join(cases)}` on {result['device']} in {result['dtype']}"
    record = records.new_record(args.name, title, shlex.join(["python", "benchmarks/bench.py", *argv]),
                                columns_of(keys), rows,
                                notes=["--quick: tiny shapes, a smoke test rather than a measurement"]
                                if result.get("quick") else [])
    print(records.write(record, args.results))


if __name__ == "__main__":
    main()
