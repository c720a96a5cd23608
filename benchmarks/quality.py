"""Quality beside the peers: convert one model several ways, optionally distil each for some minutes,
then score every checkpoint and the peers (int8/int4 rounding, HQQ, Model2Vec at each checkpoint's
bytes) on the same held-out pairs with `comera frontier`. Writes one record.

    python benchmarks/quality.py minilm --name quality-minilm --texts 400 \
        --variant "--ratio 4" --variant "--ratio 2 --dtype int8" --variant "--ratio 4 --dtype int4"

Each variant is one `comera convert MODEL VARIANT` (timed: the conversion-time column); with
``--recipe NAME --minutes M`` each is then trained by `comera train` and scored as trained. Domains:
the built-in english and python-stdlib held-out pairs, and man pages and Debian package descriptions
(built by tools/build_heldout_pairs.py from what this machine carries: text the project never reads).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record as records  # noqa: E402
from record import run_command as run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 2 ** 20
DOMAIN_HEADERS = {"english": "english", "python-stdlib": "code", "man": "man", "debian": "Debian"}


def held_out_pairs(directory: Path) -> list[Path]:
    files = [directory / "man.jsonl", directory / "debian.jsonl"]
    if not all(file.is_file() for file in files):
        run([sys.executable, str(ROOT / "tools" / "build_heldout_pairs.py"), str(directory)])
    return files


def slug(variant: str) -> str:
    return "-".join(part.lstrip("-") for part in shlex.split(variant)) or "defaults"


def convert(model: str, variant: str, out: Path) -> float:
    """Convert ``model`` with the options ``variant`` into ``out``; the seconds it took."""
    start = time.perf_counter()
    run(["comera", "--quiet", "convert", model, *shlex.split(variant), "--out", str(out), "--overwrite", "--json"])
    return time.perf_counter() - start


def train(checkpoint: Path, recipe: str, minutes: float, out: Path) -> None:
    run(["comera", "--quiet", "train", str(checkpoint), "--recipe", recipe, "--minutes", str(minutes),
         "--out", str(out), "--overwrite"])


def rows_of(frontier: dict, labels: dict[str, str], seconds: dict[str, float]) -> list[dict]:
    """One row per frontier point: what it is, its bytes, the share kept per domain and their mean."""
    rows = []
    for point in frontier["points"]:
        label = labels.get(point["label"], point["label"])
        row = {"label": label if point["kind"] == "comera" else f"{label} (peer)", "kind": point["kind"],
               "mib": round(point["bytes"] / MIB, 1), "fewer": round(frontier["dense_bytes"] / point["bytes"], 1)}
        for domain in frontier["domains"]:
            row[domain] = records.cell(round(point["kept"][domain], 3), _round(point["kept_error"].get(domain)))
        row["mean"] = records.cell(round(point["mean_kept"], 3), _round(point["mean_kept_error"]))
        row["seconds"] = round(seconds[point["label"]]) if point["label"] in seconds else None
        rows.append(row)
    return rows


def _round(error):
    return None if error is None or error != error else round(error, 3)


def columns_of(domains: list[str]) -> list[tuple]:
    return ([("label", "model"), ("mib", "MiB", ".1f"), ("fewer", "fewer bytes", ".1f")]
            + [(domain, DOMAIN_HEADERS.get(domain, domain), ".3f") for domain in domains]
            + [("mean", "mean", ".3f"), ("seconds", "conversion s", ".0f")])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model `comera convert` takes: an alias (minilm), a folder or a hub id")
    parser.add_argument("--variant", action="append", required=True,
                        help="`comera convert` options of one checkpoint, quoted; repeatable")
    parser.add_argument("--name", required=True, help="the record's name: benchmarks/results/NAME.json")
    parser.add_argument("--title", default=None)
    parser.add_argument("--results", type=Path, default=records.RESULTS, help="where the record is written")
    parser.add_argument("--texts", type=int, default=400, help="pairs per domain")
    parser.add_argument("--recipe", default=None, help="train each checkpoint with this recipe before scoring")
    parser.add_argument("--minutes", type=float, default=30.0, help="training minutes per checkpoint")
    parser.add_argument("--no-peers", action="store_true", help="score the checkpoints alone")
    parser.add_argument("--work", type=Path, default=Path("bench-work"), help="checkpoints and pairs go here")
    args = parser.parse_args(argv)
    records.exit_unless_committed()  # the record's commit must reproduce it

    args.work.mkdir(parents=True, exist_ok=True)
    pairs = held_out_pairs(args.work / "pairs")
    labels, seconds, checkpoints = {}, {}, []
    for variant in args.variant:
        out = args.work / slug(variant)
        took = convert(args.model, variant, out)
        if args.recipe:
            trained = out.with_name(out.name + "-trained")
            train(out, args.recipe, args.minutes, trained)
            out = trained
        labels[str(out)] = variant
        seconds[str(out)] = took
        checkpoints.append(str(out))
    frontier_json = args.work / f"{args.name}-frontier.json"
    run(["comera", "--quiet", "frontier", *checkpoints, *[arg for file in pairs for arg in ("--pairs", str(file))],
         "--texts", str(args.texts), "--json", str(frontier_json), *(["--no-peers"] if args.no_peers else [])])
    frontier = json.loads(frontier_json.read_text())
    after = f", then {args.minutes:g} minutes of `comera train --recipe {args.recipe}`" if args.recipe else ""
    title = args.title or f"{args.model}: share of dense recall@1 kept{after or ', right after conversion'}"
    record = records.new_record(
        args.name, title, shlex.join([sys.executable.rsplit("/", 1)[-1], "benchmarks/quality.py",
                                      *(argv if argv is not None else sys.argv[1:])]),
        columns_of(frontier["domains"]), rows_of(frontier, labels, seconds),
        notes=[f"{args.texts} pairs a domain at most (code: every held-out pair); dense float32 weights "
               f"{frontier['dense_bytes'] / MIB:.1f} MiB", *frontier["notes"]])
    print(records.write(record, args.results))


if __name__ == "__main__":
    main()
