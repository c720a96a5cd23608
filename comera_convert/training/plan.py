"""plan_training(request, objective): the one place a training run's defaults are derived.

A ``TrainOptions`` holds what the user gave (``comera train``'s flags, a recipe, a Python call); the
fields it leaves ``None`` default by the objective (CoMERA's rates for pre-training, the measured
distillation settings), by --target-ratio (an early switch, a budget, re-projection) and by how hard
the conversion cut the factorized layers. The frozen ``TrainPlan`` carries each choice with its
reason; the run's history records it, and the rank control and the Trainer read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..option_files import GIVEN
from .options import (DISTILL_DEFAULTS, DISTILL_WARMUP, PRETRAINING_DEFAULTS, SCHEDULE_FIELDS, TARGET_DEFAULTS,
                      TARGET_EARLY_SHARE, TrainOptions, default_distill_states)


@dataclass(frozen=True)
class TrainPlan:
    """A training request with every default chosen for its objective: the derived values in ``chosen``,
    each with its reason in ``reasons``; what the request gave is read through to it."""
    request: TrainOptions
    objective: str
    chosen: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict, compare=False)

    def __getattr__(self, name: str):
        if name in ("request", "chosen"):  # not set yet (a copy being built)
            raise AttributeError(name)
        if name in self.chosen:
            return self.chosen[name]
        return getattr(self.request, name)

    def to_dict(self) -> dict:
        """Every option as the run uses it (what its history records)."""
        return {**self.request.to_dict(), **self.chosen}

    def describe(self) -> dict:
        """Each derived choice as {"value", "reason"}."""
        return {name: {"value": self.chosen[name], "reason": reason} for name, reason in self.reasons.items()}

    def schedule(self) -> dict:
        """The settings of ``SCHEDULE_FIELDS`` (what a training checkpoint records)."""
        return {name: getattr(self, name) for name in SCHEDULE_FIELDS}


def plan_training(request: TrainOptions, objective: str, encoder: bool = False,
                  layers_cut: float | None = None) -> TrainPlan:
    """``request``'s defaults for ``objective`` (mlm, clm or distill); ``encoder``: the student is a
    sentence encoder (document starts help it); ``layers_cut``: how hard its conversion cut the
    factorized layers, where recorded."""
    defaults = {name: (value, "CoMERA's for pre-training") for name, value in PRETRAINING_DEFAULTS.items()}
    defaults["early_steps"] = _early_steps(request)
    defaults["distill_states"] = ("relative-mse", "relative squared error outside distillation")
    if objective == "distill":
        defaults.update(_distillation(request, encoder, layers_cut))
    if request.budgeted:
        defaults.update({name: (value, f"under {request.target_flag} (measured to keep more)")
                         for name, value in TARGET_DEFAULTS.items()})
    defaults["reproject"] = (request.reprojects, "on under --target-ratio where the ranks are cut"
                             if request.reprojects else "off without --target-ratio or rank cuts")
    chosen, reasons = {}, {}
    for name, (value, reason) in defaults.items():
        given = getattr(request, name) is not None
        chosen[name] = getattr(request, name) if given else value
        reasons[name] = GIVEN if given else reason
    return TrainPlan(request=request, objective=objective, chosen=chosen, reasons=reasons)


def _early_steps(request: TrainOptions) -> tuple[int, str]:
    if request.budgeted:
        return request.default_early_steps(), f"{TARGET_EARLY_SHARE:g} of the run before the budget starts"
    return request.default_early_steps(), "two thirds of the run (CoMERA: 20 of 30 epochs)"


def _distillation(request: TrainOptions, encoder: bool, layers_cut: float | None) -> dict:
    """The distillation recipe's measured settings, for the options left unset."""
    why = "measured for distillation (the train-minilm-distill recipe)"
    defaults = {name: (value, why) for name, value in DISTILL_DEFAULTS.items()}
    defaults["warmup_steps"] = (min(DISTILL_WARMUP, request.steps // 10), f"{DISTILL_WARMUP} steps, a tenth at most")
    defaults["document_starts"] = (DISTILL_DEFAULTS["document_starts"], "a sentence encoder: its texts' starts") \
        if encoder else (0.0, "not a sentence encoder: packed blocks only")
    states = default_distill_states(layers_cut)
    defaults["distill_states"] = (states, "by how hard the conversion cut the factorized layers" if layers_cut
                                  is not None else "no cut recorded")
    if not request.budgeted:
        defaults["early_steps"] = (request.steps, "distillation without --target-ratio keeps the size")
    else:
        defaults["beta"] = (PRETRAINING_DEFAULTS["beta"], "CoMERA's: a budget needs the size term")
    return defaults
