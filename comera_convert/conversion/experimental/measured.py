"""Rank allocation measured end to end (``allocation="measured"``): which kinds of layer deserve
more of the ``--ratio`` budget, judged by the converted model's outputs on calibration text.

Layers of one kind (the same module name up to the layer index, e.g.
``encoder.layer.*.attention.self.query``) share a rank scale s: at shared rank r they get
round(s * r), r the largest that still meets the ratio (``allocate_ranks`` with a scale). Starting
from s = 1 everywhere, one coordinate sweep tries each kind's scale times 0.6 and 1.4, converts a
copy of the model with it, and keeps the change when the mean cosine between the converted and the
dense model's mean-pooled last hidden states on the probe sequences (``Calibration.probe``) rises.
That costs two conversions per kind (17 for a BERT encoder), each of a copy of the model: it
needs memory for a second model, and is meant for models that convert in seconds.

On all-MiniLM-L6-v2 the search gives query, key, attention output and the position embedding
less than the shared rank and the word embedding and FFN output more; the held-out embedding cosine
rises before training, for a conversion many times longer, and after distillation it ends no better
(docs/findings.md), so it stays opt-in.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import RatioError
from ..allocate import LayoutChoice, allocate_ranks
from ..calibration import Calibration
from ..report import fold_layer_numbers
from ..targets import Candidate

# Each kind's scale is tried this much lower and higher, once per sweep.
SCALE_STEPS = (0.6, 1.4)
SWEEPS = 1
# A change must raise the probe cosine by more than this to be kept (not noise of rounding).
MIN_GAIN = 1e-3


@torch.no_grad()
def pooled_output(model: nn.Module, probe: torch.Tensor) -> torch.Tensor:
    """Mean-pooled last hidden states (one row per probe sequence) of any transformers model."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # no dropout: the trials are compared with one fixed reference
    try:
        hidden = model(input_ids=probe.to(device), output_hidden_states=True).hidden_states[-1]
    finally:
        model.train(was_training)
    return hidden.float().mean(dim=1).cpu()


def allocate_measured(model: nn.Module, candidates: list[Candidate], total_params: int, ratio: float,
                      choice: LayoutChoice, calibration: Calibration,
                      swap_in: Callable[[nn.Module, list[Candidate], list], None],
                      progress: Callable[[str, int, int], None] | None = None):
    """(specs, scale per kind, probe cosine): the per-kind scales that the sweep found best.

    ``swap_in(model, candidates, specs)`` converts a model's candidates in place (the converter's
    own loop), here applied to copies of the dense model. ``progress(label, trial, trials)`` is
    called before each trial conversion."""
    reference = pooled_output(model, calibration.probe)
    kinds = sorted({fold_layer_numbers(c.name) for c in candidates})
    scales = dict.fromkeys(kinds, 1.0)
    trials = 1 + SWEEPS * len(kinds) * len(SCALE_STEPS)
    done = 0

    def announce(label: str) -> None:
        nonlocal done
        if progress is not None:
            progress(f"{label} (rank search)", done, trials)
        done += 1

    def specs_for(trial: dict[str, float]):
        return allocate_ranks(candidates, total_params, ratio, choice,
                              scale=lambda c: trial[fold_layer_numbers(c.name)])[0]

    def score(trial: dict[str, float]) -> float:
        try:
            specs = specs_for(trial)
        except RatioError:
            return -math.inf  # these scales cannot meet the ratio even at rank 1: not a candidate
        clone = copy.deepcopy(model)
        swap_in(clone, [dataclasses.replace(c, module=clone.get_submodule(c.name)) for c in candidates], specs)
        return float(F.cosine_similarity(pooled_output(clone, calibration.probe), reference).mean())

    announce("the shared rank")
    best = score(scales)
    for _ in range(SWEEPS):
        for kind in kinds:
            current = scales[kind]
            for step in SCALE_STEPS:
                trial = {**scales, kind: current * step}
                announce(f"{kind} at {trial[kind]:g}x")
                got = score(trial)
                if got > best + MIN_GAIN:
                    best, scales = got, trial
    return specs_for(scales), scales, best
