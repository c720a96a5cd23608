"""Distillation train steps of compressed checkpoints side by side, in one process: interleaved
rounds, the median of each, as ratios to the first checkpoint (the step times of BENCHMARKS.md's
rank adaptation). A step is what the distillation recipe's step does at its shapes: the dense teacher's
forward, the student's forward and backward on the squared distance of the last hidden states,
and a fused AdamW step.

    python tools/compare_train_steps.py minilm-tt4 minilm-3to4 minilm-tt3 [--rounds 20] [--no-teacher]

The teacher is the recorded source of the first checkpoint; batches are 8 x 128 random tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import comera_convert
from comera_convert.conversion.report import read_report
from comera_convert.models import resolve


def distill_step(student, optimizer, teacher, batch: dict) -> None:
    with torch.no_grad():
        target = teacher(**batch).last_hidden_state if teacher is not None else None
    out = student(**batch).last_hidden_state
    loss = (out - target).square().mean() if target is not None else out.square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-teacher", action="store_true", help="time the students' steps alone")
    args = parser.parse_args()
    from transformers import AutoModel

    torch.manual_seed(0)
    teacher = None
    if not args.no_teacher:
        teacher = AutoModel.from_pretrained(resolve(read_report(args.checkpoints[0]).source)).eval()
    students = {path: comera_convert.from_pretrained(path).train() for path in args.checkpoints}
    optimizers = {path: torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True) for path, m in students.items()}
    ids = torch.randint(1000, 29000, (8, 128))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    times = {path: [] for path in students}
    for round_ in range(args.rounds + 2):  # two warm-up rounds
        for path, student in students.items():
            start = time.perf_counter()
            distill_step(student, optimizers[path], teacher, batch)
            if round_ >= 2:
                times[path].append(time.perf_counter() - start)
    first = statistics.median(times[args.checkpoints[0]])
    for path, student in students.items():
        median = statistics.median(times[path])
        params = sum(p.numel() for p in student.parameters())
        print(f"{path:40s} {params / 1e6:6.2f} M parameters  {median:.3f} s a step  {median / first:.2f}x")


if __name__ == "__main__":
    main()
