"""--target-speedup: a training run's budget counted in time where the model will serve.

As the run starts, the compressed model and its dense source are timed in the runtime, each in its fastest
form, in the same rounds (``hf/gate_prices.serving_speed``), and every bond the budget can close is priced:
the split bond of a low-rank pair (the one its two products run through; the other bonds of a longer train
change what the halves hold, not what serving computes, so their entries cost no time) and a pruned pair's
hidden neurons, each by its measured time an entry (``hf/gate_prices.entry_prices``), then scaled so that
together they predict what the whole graph saves: the model and a copy of it with every priced bond at half
its open entries are exported and timed in the same rounds (a layer alone on a chain runs slower than amid the
graph, where the runtime fuses what is around it), and the prices are scaled to that measured saving
(``calibrated``). The rank controller
then closes entries by importance per microsecond, as it closes them per parameter for --target-ratio
(``RankController.head_for_speed``). As the run ends the trained model, truncated to its open ranks, is timed
against the dense model again, and that measured speed is the one reported.
"""

from __future__ import annotations

import logging
import math
import statistics
from copy import deepcopy

import torch
from torch import nn

from ..hf.gate_prices import (MICROSECONDS, NeuronPrice, PairPrice, ServingSpeed, TooNoisy, entry_prices, fastest_forms,
                              require_runtime, serving_speed)
from ..layers import TTLinear
from ..models import load_model
from .neuron_gates import NeuronBond
from .rank_control import gated_modules
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
    """Microseconds a batch each open entry of each bond of ``modules`` costs in ``runtime`` (each layer
    alone, on a chain)."""
    keys = [price_keys(module) for _, module in modules]
    prices = entry_prices([key for bonds in keys for key in bonds if key is not None], runtime)
    return [[0.0 if key is None else prices[key] for key in bonds] for bonds in keys]


@torch.no_grad()
def halved_copy(model: nn.Module, modules: list[tuple[str, object]], prices: list[list[float]]) -> nn.Module:
    """A copy of ``model`` with every bond that has a price cut to half its open entries (the first half kept:
    what is timed is the shape, not the values)."""
    copy = deepcopy(model)
    named = dict(gated_modules(copy))
    for (name, _), bonds in zip(modules, prices):
        module = named[name]
        for gate, price in zip(module.gates, bonds):
            if price > 0:
                open_entries = gate.detach().nonzero().flatten()
                gate[open_entries[(len(open_entries) + 1) // 2:]] = 0
        module.prune_ranks(fold=True)
    return copy


def calibrated(prices: list[list[float]], modules, model: nn.Module, tokenizer, runtime: str) -> list[list[float]]:
    """``prices`` scaled so that they predict the time the whole exported graph saves when every priced bond
    halves (module docstring); ``TooNoisy`` where the rounds scatter more than that saving."""
    timed = fastest_forms({"now": (model, True), "halved": (halved_copy(model, modules, prices), True)},
                          tokenizer, runtime)
    saved = [(now - half) * MICROSECONDS for now, half in zip(timed["now"][1], timed["halved"][1])]
    measured = statistics.median(saved)
    error = statistics.stdev(saved) / len(saved) ** 0.5 if len(saved) > 1 else 0.0
    predicted = sum(price * (rank - (rank + 1) // 2) for (_, module), bonds in zip(modules, prices)
                    for price, rank in zip(bonds, module.ranks) if price > 0)
    if measured <= 2 * error or predicted <= 0:
        raise TooNoisy(f"--target-speedup: timing on this machine is too noisy to price the gates: halving every "
                       f"gated layer saved {measured / 1e3:.2f} ms a batch of the whole graph, within twice its "
                       f"standard error ({error / 1e3:.2f} ms); measure on a quieter machine, or give --target-ratio")
    scale = measured / predicted
    logger.info("prices of single layers scaled by %.2f to what the whole %s graph saves (%.1f of %.1f ms)", scale,
                runtime, measured / 1e3, predicted / 1e3)
    return [[price * scale for price in bonds] for bonds in prices]


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
    model, tokenizer = session.model, session.tokenizer
    session.controller.head_for_speed(goal, lambda modules: calibrated(bond_prices(modules, runtime), modules, model,
                                                                       tokenizer, runtime))
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
