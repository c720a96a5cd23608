"""When CoMERA's stages run: the switch from the early stage to the late one (after --early-steps, on a
loss plateau, or with --minutes at a share of the time), how far the late stage has come, and the size
budget it schedules under --target-ratio. ``RankController`` (``rank_control.py``) closes the gates;
this decides when and towards what.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .budget import scheduled_size

EARLY, LATE = "early", "late"
# Fewest late-stage steps a --minutes run is expected to have before it is warned about: the budget
# falls over a share of them (--budget-share), and each closure wants a few steps for the cores to recover.
MIN_LATE_STEPS = 20


@dataclass
class RankState:
    """What the rank control must carry across a checkpoint."""

    stage: str = EARLY
    switch_step: int | None = None
    size_at_switch: int | None = None
    target_size: int | None = None
    target_loss: float | None = None
    loss_ema: float | None = None
    ema_history: list[float] = field(default_factory=list)
    budget: int | None = None  # the late stage's scheduled TT size at the last step (--target-ratio)
    switch_progress: float | None = None  # the run's progress (0 to 1) at the switch: --minutes schedules by it
    cut_points: int = 0  # how many of rank_cuts.CUT_POINTS the run has passed (each cut or had nothing to cut)
    cuts: list[dict] = field(default_factory=list)  # rank_cuts.RankCut records, in order

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class StageSchedule:
    """The stages' timing for one run: ``options`` (its training plan), the ``state`` a checkpoint carries,
    and with --minutes the trainer's WallClock (``clock``), so that the stages and the budget follow the
    run's progress in time as well as in steps, as the learning rate does (wall_clock.py)."""

    def __init__(self, options):
        self.options = options
        self.state = RankState()
        self.clock = None

    def timed(self) -> bool:
        """Whether the run has a wall-time budget (--minutes)."""
        return self.clock is not None and self.clock.budget is not None

    def run_progress(self, step: int) -> float:
        """The run's progress, 0 to 1: the share of ``steps`` taken, or with --minutes the larger of it
        and the share of the time spent (the first to run out ends the run)."""
        progress = min(1.0, step / self.options.steps)
        return max(progress, self.clock.share_spent()) if self.timed() else progress

    def schedule_end(self) -> int:
        """The step at which the budget reaches the target ratio."""
        switch = self.state.switch_step or 0
        return switch + max(1, math.ceil(self.options.budget_share * (self.options.steps - switch)))

    def schedule_progress(self, step: int) -> float:
        """How far the budget has fallen towards the target ratio, 0 at the switch to 1 (and beyond) at the
        schedule's end: in steps, or with --minutes in the run's progress."""
        if not self.timed():
            switch = self.state.switch_step
            return (step - switch) / (self.schedule_end() - switch)
        start = self.state.switch_progress or 0.0
        return (self.run_progress(step) - start) / max(self.options.budget_share * (1.0 - start), 1e-9)

    def short_late_stage(self, step: int, ratio: float) -> str | None:
        """With --minutes and a target: one line when, at the pace of the steps so far, the time left
        holds fewer than ``MIN_LATE_STEPS`` steps for the late stage (to compress from ``ratio``); None
        otherwise."""
        if not self.timed() or not self.options.budgeted or step < 1:
            return None
        per_step = self.clock.elapsed() / step
        left = (self.clock.budget - self.clock.elapsed()) / max(per_step, 1e-9)
        if left >= MIN_LATE_STEPS:
            return None
        towards, missed = ((f"from {ratio:.2f}x to {self.options.target_ratio:g}x", "the target ratio")
                           if self.options.target_ratio is not None else
                           (f"towards {self.options.target_speedup:g}x the dense model's speed", "that speed"))
        return (f"--minutes {self.options.minutes:g} leaves about {left:.0f} steps for the late stage to compress "
                f"{towards} (at {per_step:.2f} s a step): {missed} may be missed; give more --minutes or "
                "fewer --early-steps")

    def budget_at(self, step: int) -> int | None:
        if self.state.stage != LATE or not self.options.budgeted:
            return None
        return scheduled_size(self.state.size_at_switch, self.state.target_size, self.schedule_progress(step))

    def late_progress(self, step: int) -> float | None:
        """How far the late stage has come, 0 at the switch to 1 at its end (with a target, the end of
        the budget schedule); None in the early stage."""
        if self.state.stage != LATE:
            return None
        if self.options.budgeted:
            return self.schedule_progress(step)
        if self.timed():
            start = self.state.switch_progress or 0.0
            return (self.run_progress(step) - start) / max(1.0 - start, 1e-9)
        switch = self.state.switch_step
        return (step - switch) / max(self.options.steps - switch, 1)

    def observe_loss(self, loss: float) -> None:
        decay = 0.9
        ema = self.state.loss_ema
        self.state.loss_ema = loss if ema is None else decay * ema + (1 - decay) * loss
        window = self.options.plateau_window
        if window:
            self.state.ema_history = (self.state.ema_history + [self.state.loss_ema])[-(window + 1):]

    def should_switch(self, step: int) -> bool:
        if self.state.stage != EARLY:
            return False
        early_share = self.options.early_steps / self.options.steps
        if step >= self.options.early_steps or (self.timed() and self.clock.share_spent() >= early_share):
            # Not at the last step nor with the time spent: a late stage would train nothing
            # (distillation that keeps the size runs its early stage over every step).
            return step < self.options.steps and not (self.timed() and self.clock.spent())
        history, window = self.state.ema_history, self.options.plateau_window
        if window and len(history) > window:
            gain = (history[0] - history[-1]) / max(abs(history[0]), 1e-12)
            return gain < self.options.plateau_tol
        return False
