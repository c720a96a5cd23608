"""When to round instead: compare a conversion with int8 and HQQ rounding of the same model at equal bytes.

    python examples/jobs/rounding_instead.py --ratio 4

Up to about 7x fewer bytes, rounding every weight (int8, HQQ 4-bit) keeps more than a factorization
and needs no data or training: use it when size is the goal and CPU speed is not. `comera eval
--baselines` measures the peers beside a checkpoint on the same pairs; this prints both.
"""

import argparse
import tempfile
from pathlib import Path

import comera_convert
from comera_convert.recipes import convert_options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--ratio", type=float, default=4.0)
    parser.add_argument("--texts", type=int, default=200)
    parser.add_argument("--calibration-sequences", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="rounding-"))

    options = convert_options(None, {"ratio": args.ratio, "calibration_sequences": args.calibration_sequences})
    comera_convert.convert_checkpoint(args.model, work / "converted", options, overwrite=True)
    metrics = comera_convert.evaluate(str(work / "converted"), texts=args.texts, baselines=True)
    scored = {"comera --ratio " + f"{args.ratio:g}": metrics["domains"], **metrics["baselines"]}
    for name, domains in scored.items():
        stored = metrics["sizes"]["compressed" if name.startswith("comera") else name]["bytes"]
        shares = ", ".join(f"{domain} {scores['recall_kept']:.3f}" for domain, scores in domains.items()
                           if scores.get("recall_kept") is not None)
        print(f"{name:>40}  {stored / 2 ** 20:7.2f} MiB  recall@1 kept: {shares}")


if __name__ == "__main__":
    main()
