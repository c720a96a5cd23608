"""A wall-time budget for training (`comera train --minutes`).

The learning rate follows the run's progress, the larger of the share of the budget spent and the
share of ``steps`` taken, so that a schedule that decays (cosine, linear) reaches zero when the
first of the two runs out, and training stops there. A sentence encoder distilled for minutes
gains most from a rate that has decayed by the end: all-MiniLM-L6-v2 at --ratio 4, 5 minutes on 2
CPU cores with a cosine over those minutes, keeps 0.81-0.85 of the dense retrieval recall@1 on three
natural-language domains (docs/findings.md).
"""

from __future__ import annotations

import math
import time

from torch.optim.lr_scheduler import LambdaLR


class WallClock:
    """Seconds of training spent, carried over a resumed run, against an optional budget."""

    def __init__(self, minutes: float | None):
        self.budget = minutes * 60 if minutes is not None else None
        self.already = 0.0  # spent before this process (a resumed run)
        self.started: float | None = None

    def begin(self, already: float = 0.0) -> None:
        self.already, self.started = already, time.perf_counter()

    def elapsed(self) -> float:
        return self.already + (time.perf_counter() - self.started if self.started is not None else 0.0)

    def share_spent(self) -> float:
        """The share of the budget spent, 0 to 1 (0 without a budget)."""
        return 0.0 if self.budget is None else min(1.0, self.elapsed() / self.budget)

    def spent(self) -> bool:
        return self.budget is not None and self.elapsed() >= self.budget


def decay(kind: str, progress: float) -> float:
    """The learning-rate factor after the warm-up at ``progress`` (0 to 1) of the run."""
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"no decay {kind!r}")


def wall_time_scheduler(optimizer, clock: WallClock, steps: int, warmup_steps: int, kind: str) -> LambdaLR:
    """transformers' warm-up (linear from 0 over ``warmup_steps``), then ``kind`` over the larger of
    the share of the time budget spent and the share of ``steps`` taken."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        return decay(kind, max(clock.share_spent(), min(1.0, step / steps)))

    return LambdaLR(optimizer, factor)
