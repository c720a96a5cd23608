"""A bert-base masked-LM training step on CUDA: eager CUDA-graph capture against torch.compile.

    python examples/bench_compile.py dense compile 32            # float32
    python examples/bench_compile.py r30 graph 32 --bf16          # bfloat16 autocast

MODEL: dense, r30 (every linear tt at rank 30, tt embeddings) or ratio4 (`--ratio 4`).
MODE: graph (the step captured as one CUDA graph, as `comera bench train-step` does on CUDA) or
compile (torch.compile(mode="reduce-overhead"), what `comera train --compile` hands the Trainer:
inductor's fused kernels and CUDA graphs for forward and backward; fused AdamW outside it).
Run each in a fresh process; prints the median step time over 20 steps after warm-up.
"""

import argparse
import time

import torch
from transformers import BertConfig, BertForMaskedLM

import comera_convert
from comera_convert.bench.models import training_step
from comera_convert.bench.timing import graphed, median_seconds

CONVERSIONS = {"dense": None, "r30": {"rank": 30}, "ratio4": {"ratio": 4}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=CONVERSIONS)
    parser.add_argument("mode", choices=("graph", "compile"))
    parser.add_argument("batch", type=int)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast, as comera train on CUDA")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_compile.py measures CUDA graphs and needs a CUDA device")

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig())
    if CONVERSIONS[args.model]:
        comera_convert.convert(model, uncalibrated=True, **CONVERSIONS[args.model])
    model.cuda().train()
    capture = args.mode == "graph"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=capture)
    forward = model if capture else torch.compile(model, mode="reduce-overhead")
    ids = torch.randint(0, model.config.vocab_size, (args.batch, 128), device="cuda")

    step = training_step(forward, optimizer, ids, torch.bfloat16 if args.bf16 else torch.float32)
    started = time.perf_counter()
    run = graphed(step) if capture else step
    if not capture:
        for _ in range(4):  # compiling, then cudagraph trees' warm-up and recording
            step()
    torch.cuda.synchronize()
    ready = time.perf_counter() - started
    seconds = median_seconds(run, 20, warmup=3, device="cuda")
    dtype = "bfloat16 autocast" if args.bf16 else "float32"
    print(f"{args.model} {args.mode} batch {args.batch} {dtype}: {seconds * 1e3:.2f} ms per step "
          f"(ready in {ready:.0f} s)")


if __name__ == "__main__":
    main()
