"""The serving frontier: convert one model at several ratios, optionally recover each with a training recipe,
then time and score every checkpoint side by side with `comera bench serving` (PyTorch, ONNX Runtime and
OpenVINO, float and int8) beside sentence-transformers' own int8 exports of the dense model. Writes one record
and, with --plot, the plot.

    python benchmarks/serving_frontier.py minilm --name serving-frontier-minilm --ratio 2 --ratio 2.5 \\
        --ratio 3 --ratio 4 --recipe train-minilm-distill --plot docs/images/serving-frontier-minilm.png

Each ratio is one `comera convert MODEL --ratio R` (kept in --work and reused); with --recipe each checkpoint is
then trained by `comera train --recipe` (also reused) and both are measured. ``--run "R => TRAIN OPTIONS"`` adds
a checkpoint converted at R and trained with those options (a --target-speedup or --target-ratio run). ``--runs
3`` repeats the whole bench three times and keeps each speed's mean ± standard deviation, from which the docs
may derive words that rank two routes. The held-out pairs (english, man pages, Debian descriptions) are built by
tools/build_heldout_pairs.py, the peers by benchmarks/peer_exports.py (its environments under --work). Every
figure is a ratio within a run.
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
from bench import columns_of, flatten  # noqa: E402
from quality import convert, slug, train  # noqa: E402
from record import run_command as run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOMAINS = ("english", "man", "debian")
PEER_FILES = ("onnx/model_q*int8_*.onnx", "openvino/openvino_model_qint8_quantized.xml")
# The columns a frontier reads: what each method is, its speed against dense and the fastest route with no
# comera, and the share kept on each domain and the worst.
COLUMNS = ("method", "checkpoint", "sentences_per_s", "speed_vs_dense", "speed_vs_peer", "worst_kept",
           "kept_english", "kept_man", "kept_debian", "file_mb", "forms")
# The columns that change from run to run: with --runs each becomes the mean and spread of its runs
# (record.runs_cell), from which the docs may derive words that rank two routes.
TIMED = ("sentences_per_s", "speed_vs_dense", "speed_vs_peer")


def pair_files(work: Path) -> list[Path]:
    folder = work / "pairs"
    files = [folder / f"{domain}.jsonl" for domain in DOMAINS]
    if not all(file.is_file() for file in files):
        run([sys.executable, str(ROOT / "tools" / "build_heldout_pairs.py"), str(folder)])
    return files


def peer_graphs(model: str, work: Path) -> list[Path]:
    folder = work / "peers"
    found = [next(iter(sorted(folder.glob(pattern))), None) for pattern in PEER_FILES]
    if None in found:
        run([sys.executable, str(ROOT / "benchmarks" / "peer_exports.py"), model, "--out", str(folder),
             "--envs", str(work / "peer-envs")])
        found = [next(iter(sorted(folder.glob(pattern)))) for pattern in PEER_FILES]
    return found


def checkpoints(model: str, ratios: list[str], recipe: str | None, minutes: float, work: Path,
                recover: list[str] | None = None) -> list[Path]:
    """Each ratio's conversion (and, for those of ``recover``, or all, its recovery by ``recipe``), made once in
    ``work``."""
    made = []
    for ratio in ratios:
        out = work / f"ratio-{ratio}"
        if not (out / "config.json").is_file():
            convert(model, f"--ratio {ratio}", out)
        made.append(out)
        if recipe and (not recover or ratio in recover):
            trained = work / f"ratio-{ratio}-{slug('--recipe ' + recipe)}-{minutes:g}min"
            if not (trained / "config.json").is_file():
                train(out, recipe, minutes, trained)
            made.append(trained)
    return made


def trained_runs(model: str, runs: list[str], work: Path) -> list[Path]:
    """Each ``"R => TRAIN OPTIONS"``: the conversion at R (shared with --ratio's), trained with the options."""
    made = []
    for text in runs:
        ratio, options = (part.strip() for part in text.split("=>", 1))
        source = checkpoints(model, [ratio], None, 0, work)[0]
        out = work / f"ratio-{ratio}-{slug(options)}"
        if not (out / "config.json").is_file():
            run(["comera", "--quiet", "train", str(source), *shlex.split(options), "--out", str(out), "--overwrite"])
        made.append(out)
    return made


def merged_runs(runs: list[list[dict]]) -> list[dict]:
    """The rows of several runs of one bench as one: each TIMED cell the runs' mean, spread and values, every
    other cell the first run's (the shares kept, which the runs share but for the forms timed at export)."""
    by_method = [{row["method"]: row for row in rows} for rows in runs]
    methods = [method for method in by_method[0] if all(method in run for run in by_method)]
    merged = []
    for method in methods:
        row = dict(by_method[0][method])
        for key in TIMED:
            if all(run[method].get(key) is not None for run in by_method):
                row[key] = records.runs_cell([run[method][key] for run in by_method])
        merged.append(row)
    return merged


def bench_runs(made: list[Path], pairs: list[Path], peers: list[Path], args) -> list[list[dict]]:
    """``args.runs`` runs of `comera bench serving` over the checkpoints, each its rows (the plot is the last's)."""
    runs = []
    for index in range(args.runs):
        plot = ["--plot", str(args.plot)] if args.plot and index == args.runs - 1 else []
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            run(["comera", "--quiet", "bench", "serving", *[a for c in made for a in ("--checkpoint", str(c))],
                 *[a for p in pairs for a in ("--pairs", str(p))], *[a for p in peers for a in ("--peer", str(p))],
                 "--texts", str(args.texts), "--batch", str(args.batch), "--repeats", str(args.repeats),
                 "--json", str(out), *plot])
            runs.append(json.loads(out.read_text())["rows"])
    return runs


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model `comera convert` takes: an alias (minilm, all-mpnet-base-v2)")
    parser.add_argument("--ratio", action="append", required=True, help="a --ratio to convert at; repeatable")
    parser.add_argument("--recipe", default=None, help="also recover each checkpoint with this training recipe")
    parser.add_argument("--minutes", type=float, default=30.0, help="training minutes of each recovery")
    parser.add_argument("--recover", action="append", default=None, metavar="RATIO",
                        help="recover only the conversion at this ratio (repeatable) [default: every one]")
    parser.add_argument("--run", action="append", default=[],
                        help="'R => TRAIN OPTIONS': also a checkpoint converted at R and trained so; repeatable")
    parser.add_argument("--name", required=True, help="the record's name: benchmarks/results/NAME.json")
    parser.add_argument("--title", default=None)
    parser.add_argument("--texts", type=int, default=256, help="texts timed a round, and pairs per domain")
    parser.add_argument("--batch", type=int, default=32, help="texts embedded at a time")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--runs", type=int, default=1,
                        help="whole bench runs; from 3, each speed is the runs' mean ± standard deviation")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the frontier to this PNG")
    parser.add_argument("--results", type=Path, default=records.RESULTS, help="where the record is written")
    parser.add_argument("--work", type=Path, default=Path("bench-work"), help="checkpoints, pairs and peers go here")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs: expected 1 or more whole runs, got {args.runs}")
    records.exit_unless_committed()  # the record's commit must reproduce it

    args.work.mkdir(parents=True, exist_ok=True)
    pairs, peers = pair_files(args.work), peer_graphs(args.model, args.work)
    made = checkpoints(args.model, args.ratio, args.recipe, args.minutes, args.work, args.recover)
    made += trained_runs(args.model, args.run, args.work)
    runs = [[flatten(row) for row in rows] for rows in bench_runs(made, pairs, peers, args)]
    shape = runs[0][0]["shape"]
    rows = merged_runs(runs) if len(runs) > 1 else runs[0]
    keys = [key for key in COLUMNS if any(key in row for row in rows)]
    rows = [{key: row.get(key) for key in keys} for row in rows]
    which = f"--ratio {', '.join(args.recover)}" if args.recover else "each"
    recovered = f", {which} also after {args.minutes:g} minutes of `{args.recipe}`" if args.recipe else ""
    title = args.title or (f"{args.model} at --ratio {', '.join(args.ratio)}{recovered}: speed against the fastest "
                           f"route with no comera, and the share of dense recall@1 kept")
    record = records.new_record(
        args.name, title, shlex.join(["python", "benchmarks/serving_frontier.py", *argv]), columns_of(keys), rows,
        notes=[f"{shape}; speeds are medians of {args.repeats} rounds' ratios, each checkpoint timed in rounds "
               "of its own beside dense PyTorch and the routes with no comera"
               + (f"; each speed the mean ± standard deviation of {args.runs} runs" if args.runs > 1 else ""),
               "speed_vs_peer: against the fastest route with no comera in the same rounds (sentence-transformers' "
               "own int8 exports, and the dense graphs as its backends make them)"])
    print(records.write(record, args.results))


if __name__ == "__main__":
    main()
