"""Choose the ratio after converting: convert mildly, then close rank gates while distilling down to a target.

    python examples/jobs/ratio_after_converting.py --ratio 2 --target-ratio 4

The same with the command line:
    comera convert minilm --ratio 2 --out minilm-2x
    comera train minilm-2x --recipe train-minilm-to-target --target-ratio 4 --out minilm-2to4
The budget closes TT ranks, pruned feed-forward pairs' neurons and the directions of layers the
conversion left dense alike. BENCHMARKS.md (rank adaptation) compares it with converting at the
final ratio and distilling for the same minutes.
"""

import argparse
import tempfile
from pathlib import Path

import comera_convert
from comera_convert.recipes import convert_options, train_options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--ratio", type=float, default=2.0, help="the milder conversion")
    parser.add_argument("--target-ratio", type=float, default=4.0)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=None, help="cap the steps")
    parser.add_argument("--calibration-sequences", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="target-"))

    options = convert_options(None, {"ratio": args.ratio, "calibration_sequences": args.calibration_sequences})
    comera_convert.convert_checkpoint(args.model, work / "converted", options, overwrite=True)
    overrides = {"target_ratio": args.target_ratio, "minutes": args.minutes, "steps": args.steps,
                 "early_steps": max(1, args.steps // 20) if args.steps else None}  # the switch at 5 % of a capped run
    result = comera_convert.train(str(work / "converted"), train_options("train-minilm-to-target", overrides),
                                  work / "trained", overwrite=True)
    print(f"{work / 'trained'}: {result.ratio_after:.2f}x smaller than dense (target {args.target_ratio:g}x), "
          f"held-out loss {result.held_out_before:.3f} -> {result.held_out_after:.3f}")


if __name__ == "__main__":
    main()
