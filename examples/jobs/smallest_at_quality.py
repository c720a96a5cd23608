"""The smallest model that keeps a given share of the dense model's retrieval: integer storage of the factors.

    python examples/jobs/smallest_at_quality.py --keep 0.9        # the packaged MiniLM, three candidates

Each candidate is one conversion stored as integers; `comera frontier` scores them and the rounding
peers (int8, HQQ) on the same held-out pairs, and the smallest one that keeps `--keep` wins. For
the largest cuts, distil the winner quantization-aware (`comera train CKPT --recipe
train-minilm-distill`: an integer checkpoint trains on its grid and is written on it).
"""

import argparse
import tempfile
from pathlib import Path

import comera_convert
from comera_convert.frontier import size_frontier
from comera_convert.recipes import convert_options

CANDIDATES = {"ratio-2-int8": {"ratio": 2.0, "dtype": "int8"}, "ratio-4-int8": {"ratio": 4.0, "dtype": "int8"},
              "ratio-4-int4": {"ratio": 4.0, "dtype": "int4"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--keep", type=float, default=0.9, help="share of dense recall@1 to keep, mean of domains")
    parser.add_argument("--texts", type=int, default=200, help="held-out pairs per domain")
    parser.add_argument("--pairs", action="append", default=[], help="JSONL query/document pairs of your domain")
    parser.add_argument("--calibration-sequences", type=int, default=None)
    parser.add_argument("--no-peers", action="store_true", help="score the candidates alone")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="smallest-"))

    paths = []
    for name, chosen in CANDIDATES.items():
        options = convert_options(None, {**chosen, "calibration_sequences": args.calibration_sequences})
        comera_convert.convert_checkpoint(args.model, work / name, options, overwrite=True)
        paths.append(str(work / name))
    frontier = size_frontier(paths, pairs=args.pairs, texts=args.texts, peers=not args.no_peers)
    for point in frontier["points"]:  # largest first
        fewer = frontier["dense_bytes"] / point["bytes"]
        print(f"{point['label']:>40}  {point['kind']:6}  {fewer:5.1f}x fewer bytes  keeps {point['mean_kept']:.3f}")
    kept = [p for p in frontier["points"] if p["kind"] == "comera" and p["mean_kept"] >= args.keep]
    if kept:
        best = min(kept, key=lambda point: point["bytes"])
        print(f"smallest comera checkpoint keeping {args.keep}: {best['label']}")
    else:
        print(f"no candidate keeps {args.keep}: distil one (comera train CKPT --recipe train-minilm-distill)")


if __name__ == "__main__":
    main()
