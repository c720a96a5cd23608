"""Keep pre-training a compressed model on a GPU: ranks of 8 for the tensor cores, compiled and graphed steps.

    python examples/jobs/pretrain_on_gpu.py --model bert-base --data ./corpus --steps 2000

The same with the command line (torchrun and --fsdp to shard it over several GPUs):
    comera convert bert-base --ratio 4 --rank-multiple 8 --out bert-base-tt4
    comera train bert-base-tt4 --objective mlm --data ./corpus --compile --per-device-train-batch-size 32 \
        --rank-multiple 8 --target-ratio 8 --out bert-base-tt8
    torchrun --nproc_per_node 8 -m comera_convert train bert-base-tt4 --fsdp ... --out run
Without a GPU it runs the same steps on the CPU, uncompiled: a check of the path, not a measurement.
"""

import argparse
import tempfile
from pathlib import Path

import torch

import comera_convert
from comera_convert.recipes import convert_options, train_options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--data", default="english", help="training text: a folder, a file, a dataset or a corpus")
    parser.add_argument("--ratio", type=float, default=4.0)
    parser.add_argument("--target-ratio", type=float, default=None, help="close ranks while training, down to it")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--calibration-sequences", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="pretrain-"))
    gpu = torch.cuda.is_available()

    options = convert_options(None, {"ratio": args.ratio, "rank_multiple": 8,  # bf16 tensor cores run tiles of 8
                                     "calibration_sequences": args.calibration_sequences,
                                     "device": "cuda" if gpu else None})
    comera_convert.convert_checkpoint(args.model, work / "converted", options, overwrite=True)
    training = train_options(None, {"objective": "mlm", "data": args.data, "steps": args.steps,
                                    "batch_size": args.batch_size, "seq_len": args.seq_len, "rank_multiple": 8,
                                    "target_ratio": args.target_ratio, "compile": gpu,
                                    "early_steps": max(1, args.steps // 20) if args.target_ratio else None})
    result = comera_convert.train(str(work / "converted"), training, work / "trained", overwrite=True)
    print(f"trained {work / 'trained'} on {'the GPU' if gpu else 'the CPU'}: held-out loss "
          f"{result.held_out_before:.3f} -> {result.held_out_after:.3f}, {result.ratio_after:.2f}x smaller than dense")


if __name__ == "__main__":
    main()
