"""--target-speedup: a training run's budget counted in time where the model will serve.

As the run starts, the compressed model and its dense source are timed in the runtime, each in its fastest
form, in the same rounds (``hf/gate_prices.serving_speed``), and every bond the budget can close is priced:
the split bond of a low-rank pair (the one its two products run through; the other bonds of a longer train
change what the halves hold, not what serving computes, so their entries cost no time) and a pruned pair's
hidden neurons, each by its measured time an entry (``hf/gate_prices.entry_prices``). The rank controller
then closes entries by importance per microsecond, as it closes them per parameter for --target-ratio
(``RankController.head_for_speed``). As the run ends the trained model, truncated to its open ranks, is timed
against the dense model again, and that measured speed is the one reported.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..hf.gate_prices import NeuronPrice, PairPrice, ServingSpeed, entry_prices, require_runtime, serving_speed
from ..layers import TTLinear
from ..models import load_model
from .neuron_gates import NeuronBond
from .speed_goal import SpeedGoal

logger = logging.getLogger("comera_convert.training")

RANK_STEP = 32  # ranks and widths priced alike when they round up to the same multiple of this
# A run reaches its speed when the measured speed is at least this share of --target-speedup.
SPEED_TOLERANCE = 0.95


def price_keys(module) -> list:
    """What one entry of each of ``module``'s bonds costs in time, as a key ``entry_prices`` prices (None:
    nothing served runs through it)."""
    if isinstance(module, NeuronBond):
        return [NeuronPrice(module.up.in_features, _stepped(module.ranks[0]))]
    keys: list = [None] * len(module.ranks)
    if isinstance(module, TTLinear) and module.spec.layout == "tt":
        bond = module.spec.split - 1
        keys[bond] = PairPrice(module.in_features, module.out_features, _stepped(module.ranks[bond]))
    return keys


def _stepped(units: int) -> int:
    return max(RANK_STEP, math.ceil(units / RANK_STEP) * RANK_STEP)


def bond_prices(modules: list[tuple[str, object]], runtime: str) -> list[list[float]]:
    """Microseconds a batch each open entry of each bond of ``modules`` costs in ``runtime``."""
    keys = [price_keys(module) for _, module in modules]
    prices = entry_prices([key for bonds in keys for key in bonds if key is not None], runtime)
    return [[0.0 if key is None else prices[key] for key in bonds] for bonds in keys]


def dense_model(session) -> nn.Module:
    """The dense model the speed is measured against: the teacher, or the checkpoint's recorded source."""
    if session.teacher is not None:
        return session.teacher
    model, _ = load_model(session.source, task="base")
    return model.eval()


def head_for_speed(session) -> tuple[SpeedGoal, ServingSpeed, nn.Module]:
    """Time the model and its dense source, price the gates, and set the rank controller's budget in time;
    returns the goal, the speed at the start and the dense model (timed again at the end)."""
    options = session.options
    runtime = options.speed_runtime
    require_runtime(runtime, "--target-speedup")
    dense = dense_model(session)
    logger.info("timing the model and its dense source in %s, and pricing the gates", runtime)
    with torch.no_grad():
        start = serving_speed(session.model.eval(), dense, session.tokenizer, runtime)
    goal = SpeedGoal(runtime, options.target_speedup, start.dense_microseconds, start.microseconds)
    session.controller.head_for_speed(goal, lambda modules: bond_prices(modules, runtime))
    logger.info("the model serves %.2fx the dense model's speed in %s (dense fastest in %s): heading for %gx",
                start.speedup, runtime, start.dense_form, options.target_speedup)
    return goal, start, dense


def speed_shortfall(reached: ServingSpeed, target: float) -> str | None:
    """One line where the measured speed falls short of ``target`` by more than the tolerance."""
    if reached.speedup >= SPEED_TOLERANCE * target:
        return None
    return (f"target speedup {target:g}x missed: the exported model runs {reached.speedup:.2f}x the dense model in "
            f"{reached.runtime} (measured; the prices steer the budget, the graph decides): a lower "
            "--target-speedup, or more --minutes, reaches it")
