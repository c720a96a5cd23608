"""Ranks that shrink for real: the closed bond indices cut out of the model while it trains.

A closed gate entry is a mask: the cores keep their shape and every step still multiplies through
the zeroed slices. At the stage switch and at each quarter of the late stage (``CUT_POINTS``) the
gated layers are cut to their open ranks in place (``TTModule.cut_to_open_ranks_``): the cores and
gates stay the same parameters, only smaller, and AdamW's moments are cut the same way, so the
optimizer steps on as if nothing happened and every later step multiplies smaller cores. A few
cuts, not one per closure: under ``--compile`` each one recompiles (and re-captures the CUDA
graphs) once.

Not under torchrun: DDP's gradient buckets and FSDP's flat shards keep the shapes they were built
with, so there the closed ranks stay masks until the export cuts them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from ..conversion import count_params

logger = logging.getLogger("comera_convert.training")

# Where in the late stage the ranks are cut (0: the switch, 1: the end of the budget schedule or of
# the late stage): each cut makes a compiled model recompile once, so a handful.
CUT_POINTS = (0.0, 0.25, 0.5, 0.75, 1.0)
# Steps either side of a cut whose mean time the summary reports (fewer where the run has fewer).
TIMING_WINDOW = 20


@dataclass
class RankCut:
    """One cut: the step after which it ran, and the parameters the model stored before and after."""

    step: int
    params_before: int
    params_after: int

    def to_dict(self) -> dict:
        return asdict(self)


def points_reached(progress: float | None) -> int:
    """How many of ``CUT_POINTS`` a late stage ``progress`` of the way along has passed (0 before it)."""
    return 0 if progress is None else sum(point <= progress for point in CUT_POINTS)


def rewrite_state(optimizer, param: torch.Tensor, rewrite, shaped_like_param: bool = True) -> None:
    """Replace each tensor of ``param``'s optimizer state by ``rewrite(tensor)``: those of the
    parameter's shape (AdamW's two moments), or every one (its step too)."""
    state = optimizer.state.get(param) if optimizer is not None else None
    for key, value in (state or {}).items():
        if torch.is_tensor(value) and (value.shape == param.shape or not shaped_like_param):
            state[key] = rewrite(value)


def moments_cutter(optimizer):
    """A callback for ``cut_to_open_ranks_`` that cuts each parameter's optimizer state (AdamW's two
    moments) the way the parameter is cut."""
    return lambda param, cut: rewrite_state(optimizer, param, cut)


def cut_closed_ranks(controller, optimizer, step: int) -> RankCut | None:
    """Cut every gated layer with closed entries to its open ranks, with its optimizer state, and
    re-index the controller's per-entry records; None when nothing was closed."""
    due = [i for i, (_, module) in enumerate(controller.modules) if module.ranks != module.bond_dims]
    if not due:
        return None
    before = count_params(controller.model)
    cut_state = moments_cutter(optimizer)
    for i in due:
        keep = controller.modules[i][1].cut_to_open_ranks_(cut_state)
        controller.reindex(i, keep)
    cut = RankCut(step=step, params_before=before, params_after=count_params(controller.model))
    logger.info("step %d: closed ranks cut out of the cores: %.2f M -> %.2f M parameters stored", step,
                cut.params_before / 1e6, cut.params_after / 1e6)
    return cut


def step_times(history: list[dict], cuts: list[dict], window: int = TIMING_WINDOW) -> list[dict]:
    """Each cut with the mean step time (seconds) of up to ``window`` steps before and after it, from
    the history's cumulative seconds; a side without steps (the run ended) gets None."""
    seconds = {record["step"]: record["seconds"] for record in history if "seconds" in record}
    timed = []
    for cut in cuts:
        step = cut["step"]
        timed.append({**cut, "step_seconds_before": _mean_step(seconds, step - window, step),
                      "step_seconds_after": _mean_step(seconds, step, step + window)})
    return timed


def _mean_step(seconds: dict[int, float], first: int, last: int) -> float | None:
    """Mean seconds a step from step ``first`` to step ``last`` (as far as the history reaches)."""
    first = max(first, min(seconds, default=first))
    last = min(last, max(seconds, default=last))
    if last <= first or first not in seconds or last not in seconds:
        return None
    return (seconds[last] - seconds[first]) / (last - first)
