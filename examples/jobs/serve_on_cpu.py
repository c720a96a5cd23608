"""Serve a sentence encoder on a CPU: convert it, distil it, embed with int8 compute in sentence-transformers.

    python examples/jobs/serve_on_cpu.py                       # the packaged MiniLM, 30 minutes of distillation
    python examples/jobs/serve_on_cpu.py --minutes 0           # convert and serve, no training

The same with the command line:
    comera convert minilm --ratio 4 --out minilm-tt4
    comera train minilm-tt4 --recipe train-minilm-distill --out minilm-tt4-trained
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer

import comera_convert
from comera_convert.models import resolve
from comera_convert.recipes import convert_options, train_options

TEXTS = ["A compressed encoder embeds this sentence.", "def add(a, b): return a + b",
         "ls lists the files of a directory.", "The weather is lovely in spring."] * 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm", help="a sentence encoder: an alias, a folder or a hub id")
    parser.add_argument("--ratio", type=float, default=4.0)
    parser.add_argument("--minutes", type=float, default=30.0, help="distillation minutes (0: none)")
    parser.add_argument("--steps", type=int, default=None, help="cap the distillation's steps")
    parser.add_argument("--calibration-sequences", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="keep the checkpoints here")
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="serve-"))

    converted = work / "converted"
    options = convert_options(None, {"ratio": args.ratio, "calibration_sequences": args.calibration_sequences})
    comera_convert.convert_checkpoint(args.model, converted, options, overwrite=True)
    served = converted
    if args.minutes > 0:
        served = work / "trained"
        overrides = {"minutes": args.minutes, "steps": args.steps}
        comera_convert.train(str(converted), train_options("train-minilm-distill", overrides), served,
                             overwrite=True)

    dense = SentenceTransformer(str(resolve(args.model)), device="cpu")
    compressed = SentenceTransformer(str(served), device="cpu")  # after `import comera_convert`
    comera_convert.use_int8_compute(compressed)  # each low-rank or pruned pair as int8 GEMMs, in place
    timings = {}
    for name, model in (("dense", dense), ("comera, int8 compute", compressed)):
        model.encode(TEXTS[:8])  # warm-up
        start = time.perf_counter()
        embeddings = model.encode(TEXTS, batch_size=32, convert_to_tensor=True)
        timings[name] = (time.perf_counter() - start, embeddings)
    cosine = torch.nn.functional.cosine_similarity(timings["dense"][1], timings["comera, int8 compute"][1]).mean()
    speed = timings["dense"][0] / timings["comera, int8 compute"][0]
    print(f"served {served}: {speed:.2f}x the dense model's speed here, mean cosine to its embeddings {cosine:.3f}")


if __name__ == "__main__":
    main()
