"""Training routes side by side at equal time: convert one model several ways, train every checkpoint
at once for the same minutes (each on one thread, so each gets an equal share of the machine), then
score them together with `comera frontier`. Writes one record.

    python benchmarks/side_by_side.py minilm --name rank-adaptation-minilm --minutes 30 \\
        --run "--ratio 2 => --recipe train-minilm-to-target --target-ratio 4" \\
        --run "--ratio 4 => --recipe train-minilm-distill"

Each run is `comera convert MODEL <left>` then `comera train <converted> <right> --minutes M`. A
conversion already in the work folder (same options) is reused. Columns: the steps each run took, its
held-out loss, the ratio reached and the bytes on disk against dense, the share of dense recall@1 kept
per domain with its standard error, and the mean seconds a step over the last quarter of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record as records  # noqa: E402
from quality import DOMAIN_HEADERS, _round, held_out_pairs, slug  # noqa: E402
from record import run_command as run  # noqa: E402

SEPARATOR = "=>"


def split_run(text: str) -> tuple[str, str]:
    """A run's conversion options and training options."""
    if SEPARATOR not in text:
        raise SystemExit(f"error: a --run is 'CONVERT OPTIONS {SEPARATOR} TRAIN OPTIONS', got {text!r}")
    convert, train = text.split(SEPARATOR, 1)
    return convert.strip(), train.strip()


def convert_once(model: str, options: str, work: Path) -> Path:
    out = work / slug(options)
    if not (out / "config.json").is_file():
        run(["comera", "--quiet", "convert", model, *shlex.split(options), "--out", str(out), "--overwrite"])
    return out


def train_all(jobs: list[tuple[Path, str, Path]], minutes: float) -> None:
    """Train every (checkpoint, options, out) at once, one thread each; fail on the first that fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running = []
    for checkpoint, options, out in jobs:
        command = ["comera", "--quiet", "train", str(checkpoint), *shlex.split(options), "--minutes", str(minutes),
                   "--out", str(out), "--overwrite"]
        log = open(out.with_suffix(".log"), "w")
        running.append((command, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)))
    for command, log, process in running:
        process.wait()
        log.close()
        if process.returncode:
            raise SystemExit(f"error: {shlex.join(command)} failed ({process.returncode}); see {log.name}")


def last_quarter_step_seconds(history: list[dict]) -> float | None:
    """Mean seconds a step over the last quarter of the run's steps (from the history's cumulative seconds)."""
    timed = [h for h in history if "seconds" in h]
    if len(timed) < 8:
        return None
    first, last = timed[3 * len(timed) // 4], timed[-1]
    return (last["seconds"] - first["seconds"]) / max(last["step"] - first["step"], 1)


def row_of(label: str, trained: Path, point: dict, frontier: dict) -> dict:
    training = json.loads((trained / "comera_report.json").read_text())["extra"]["training"]
    history = json.loads((trained / "comera_history.json").read_text())
    row = {"label": label, "steps": training["steps"], "loss": round(training["held_out_loss_after"], 3),
           "ratio": round(training.get("ratio_reached") or history[-1]["ratio"], 2),
           "fewer": round(frontier["dense_bytes"] / point["bytes"], 2),
           "step_seconds": _round(last_quarter_step_seconds(history))}
    for domain in frontier["domains"]:
        row[domain] = records.cell(round(point["kept"][domain], 3), _round(point["kept_error"].get(domain)))
    row["mean"] = records.cell(round(point["mean_kept"], 3), _round(point["mean_kept_error"]))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model `comera convert` takes: an alias (minilm), a folder or a hub id")
    parser.add_argument("--run", action="append", required=True,
                        help=f"'CONVERT OPTIONS {SEPARATOR} TRAIN OPTIONS' of one route, quoted; repeatable")
    parser.add_argument("--name", required=True, help="the record's name: benchmarks/results/NAME.json")
    parser.add_argument("--title", default=None)
    parser.add_argument("--minutes", type=float, default=30.0, help="training minutes of every run (side by side)")
    parser.add_argument("--texts", type=int, default=400, help="pairs per domain")
    parser.add_argument("--results", type=Path, default=records.RESULTS, help="where the record is written")
    parser.add_argument("--work", type=Path, default=Path("bench-work"), help="checkpoints and pairs go here")
    args = parser.parse_args(argv)
    records.exit_unless_committed()  # the record's commit must reproduce it

    args.work.mkdir(parents=True, exist_ok=True)
    pairs = held_out_pairs(args.work / "pairs")
    routes = [split_run(text) for text in args.run]
    jobs, labels = [], {}
    for convert, train in routes:
        checkpoint = convert_once(args.model, convert, args.work)
        out = args.work / f"{slug(convert)}--{slug(train)}"
        jobs.append((checkpoint, train, out))
        labels[str(out)] = f"`{convert}`, then `{train}`"
    train_all(jobs, args.minutes)
    frontier_json = args.work / f"{args.name}-frontier.json"
    run(["comera", "--quiet", "frontier", *[str(out) for _, _, out in jobs],
         *[arg for file in pairs for arg in ("--pairs", str(file))], "--texts", str(args.texts), "--no-peers",
         "--json", str(frontier_json)])
    frontier = json.loads(frontier_json.read_text())
    points = {point["label"]: point for point in frontier["points"]}
    rows = [row_of(labels[str(out)], out, points[str(out)], frontier) for _, _, out in jobs]
    columns = ([("label", "run"), ("steps", "steps"), ("loss", "held-out loss", ".3f"), ("ratio", "ratio", ".2f"),
                ("fewer", "fewer bytes", ".2f")]
               + [(domain, DOMAIN_HEADERS.get(domain, domain), ".3f") for domain in frontier["domains"]]
               + [("mean", "mean", ".3f"), ("step_seconds", "s a step, last quarter", ".3f")])
    title = args.title or f"{args.model}: training routes side by side, {args.minutes:g} minutes each"
    record = records.new_record(
        args.name, title, shlex.join([sys.executable.rsplit("/", 1)[-1], "benchmarks/side_by_side.py",
                                      *(argv if argv is not None else sys.argv[1:])]),
        columns, rows,
        notes=[f"every run trained at once, one thread each, for {args.minutes:g} minutes of wall time",
               f"{args.texts} pairs a domain at most (code: every held-out pair); shares of dense recall@1 kept "
               "± standard error", *frontier["notes"]])
    print(records.write(record, args.results))


if __name__ == "__main__":
    main()
