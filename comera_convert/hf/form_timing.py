"""Each compressed layer's fastest serving form and precision on this machine, chosen by timing it.

A low-rank pair can serve as two GEMMs or multiplied out as one (``layers/serving_forms.py``), and in an int8
graph each linear can be rounded to int8 or left in the runtime's float precision (bfloat16 where OpenVINO
finds the instructions, float32 otherwise). Two products do fewer multiply-adds than their product where the
rank is under about half the width, yet each GEMM has a cost of its own (and in int8 its input is quantized
first), so which is fastest depends on the shape, the rank, the runtime and the CPU. The choice is measured,
as torch.compile's autotuning and oneDNN's kernel selection measure theirs, and written into the export.

Layers are grouped by shape (inputs, rank, outputs; a plain linear has no rank). For each group every
candidate (form x precision) runs in the runtime as a chain of the group's own layers (``chain_timing.py``),
the candidates taking turns for ``rounds`` rounds; the fastest median wins. Where the spread of the winner's
rounds is wider than its lead over the default (two int8 GEMMs for a pair, int8 for a plain linear), the
default is kept and the group marked as too noisy to rank.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..choices import FORM_REQUESTS, SERVING_RUNTIMES
from ..errors import ConfigError, expected
from ..layers.pruned_linear import PrunedLinear
from ..layers.serving_forms import FORMS, factor_pairs, linear_of, merged_form, pair_form
from ..layers.tt_linear import TTLinear, dense_weight_of, is_dense_linear
from ..machine import cpu_description
from ..progress import Progress, no_progress
from .chain_timing import CHAIN_DEPTH, TIMERS, TIMING_SEED, ChainLayer, timed_rounds

RUNTIMES = SERVING_RUNTIMES
FORMS_FILE = "serving_forms.json"  # beside the graphs: each graph's plan and the CPU it was timed on
PRECISIONS = ("int8", "float")
ROUNDS = 7  # every candidate runs once a round; the median round is its time
WIDTH_STEP = 64  # plain linears whose widths round up to the same multiple of this are timed as one group
SERVING_SHAPE = (32, 128)  # batch and tokens a timed batch has: sentence-transformers' batch, a mid-length text


@dataclass
class FormChoice:
    """One group of layers of a shape: the candidates' median milliseconds and the one chosen."""

    layers: list[str]
    shape: list[int]  # [inputs, rank, outputs] for a pair, [inputs, outputs] for a plain linear
    milliseconds: dict[str, float]  # "form/precision" -> median ms of the chain
    spread: dict[str, float]  # "form/precision" -> (slowest - fastest round) ms
    chosen: str
    noisy: bool = False

    @property
    def form(self) -> str:
        return self.chosen.split("/")[0]

    @property
    def precision(self) -> str:
        return self.chosen.split("/")[1]


@dataclass
class FormPlan:
    """The forms and precisions chosen for a model's layers in one runtime on this machine."""

    runtime: str
    int8: bool
    shape: list[int]  # [batch, tokens] of the timed batch
    groups: list[FormChoice] = field(default_factory=list)

    def forms(self) -> dict[str, str]:
        """Each pair's form by layer name (plain linears have none)."""
        return {name: group.form for group in self.groups if len(group.shape) == 3 for name in group.layers}

    def float_layers(self) -> list[str]:
        """The layers left in float in an int8 graph."""
        return [name for group in self.groups if group.precision == "float" for name in group.layers]

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> list[str]:
        """One line per group: its shape, its layers' count, the choice and the candidates' times."""
        lines = []
        for group in self.groups:
            shape = "x".join(map(str, group.shape))
            times = ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(group.milliseconds.items(), key=lambda i: i[1]))
            noisy = " (too noisy to rank: the default kept)" if group.noisy else ""
            lines.append(f"{shape} ({len(group.layers)} layers): {group.chosen}{noisy}; ms per chain: {times}")
        return lines


def default_choice(shape: list[int], int8: bool) -> str:
    """What a group serves as without timing: two GEMMs through a pair's bond, int8 in an int8 graph."""
    return fixed_choice(shape, int8, "pair")


def candidates(shape: list[int], int8: bool) -> list[str]:
    forms = FORMS if len(shape) == 3 else ("linear",)
    precisions = PRECISIONS if int8 else ("float",)
    return [f"{form}/{precision}" for form in forms for precision in precisions]


def layer_groups(model: nn.Module) -> dict[tuple, list[str]]:
    """The model's linear layers by shape: each low-rank pair by (inputs, rank, outputs), each other linear
    inside its blocks (pruned or left dense) by (inputs, outputs), each rounded up to ``WIDTH_STEP`` (the
    pruned layers of a model keep a few neurons more or less each: their precision is one choice)."""
    groups: dict[tuple, list[str]] = {}
    pairs = factor_pairs(model)
    for name, layer in pairs.items():
        groups.setdefault((layer.in_features, layer.ranks[0], layer.out_features), []).append(name)
    for name, module in model.named_modules():
        if isinstance(module, PrunedLinear) or (is_dense_linear(module) and ".layer." in f".{name}."):
            outputs, inputs = dense_weight_of(module)[0].shape
            groups.setdefault((_stepped(inputs), _stepped(outputs)), []).append(name)
    return groups


def _stepped(width: int) -> int:
    return -(-width // WIDTH_STEP) * WIDTH_STEP


def plan_forms(model: nn.Module, runtime: str, int8: bool, forms: str = "auto", shape: tuple[int, int] = SERVING_SHAPE,
               rounds: int = ROUNDS, progress: Progress = no_progress) -> FormPlan:
    """The serving form and precision of each of ``model``'s layers in ``runtime``: with ``forms="auto"``
    each group's fastest here (module docstring), else ``forms`` for every pair and, in an ``int8`` graph,
    int8 for every layer."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"--runtime: {expected('one of ' + ', '.join(RUNTIMES), runtime)}")
    if forms not in FORM_REQUESTS:
        raise ConfigError(f"--forms: {expected('one of ' + ', '.join(FORM_REQUESTS), forms)}")
    plan = FormPlan(runtime, int8, list(shape))
    groups = layer_groups(model)
    for index, (key, names) in enumerate(groups.items()):
        fixed = default_choice(list(key), int8) if forms == "auto" else fixed_choice(list(key), int8, forms)
        if forms != "auto" or len(candidates(list(key), int8)) == 1:
            plan.groups.append(FormChoice(names, list(key), {}, {}, fixed))
            continue
        progress(f"timing the serving forms of {'x'.join(map(str, key))} layers", index, len(groups))
        plan.groups.append(_chosen(names, list(key), _timed_candidates(model, names, key, runtime, int8, shape,
                                                                        rounds), int8))
    return plan


def fixed_choice(shape: list[int], int8: bool, form: str) -> str:
    """``form`` for a pair (a plain linear has one form), int8 in an int8 graph."""
    return f"{form if len(shape) == 3 else 'linear'}/{'int8' if int8 else 'float'}"


def _timed_candidates(model, names, key, runtime, int8, shape, rounds) -> dict[str, list[float]]:
    """Each candidate's rounds, on a chain of the group's layers of the first one's exact width."""
    modules = [model.get_submodule(name) for name in names]
    modules = [module for module in modules if _inputs(module) == _inputs(modules[0])][:CHAIN_DEPTH]
    timer = TIMERS[runtime]
    runners = {candidate: timer(_chain(modules, candidate.split("/")[0]), candidate.endswith("int8"),
                                _inputs(modules[0]), shape)
               for candidate in candidates(list(key), int8)}
    return timed_rounds(runners, rounds)


def write_plans(plans: dict[str, FormPlan], directory: Path) -> dict:
    """The plans of a folder's graphs (by file name) and the CPU they were timed on, written to
    ``directory/FORMS_FILE``; returns what was written."""
    written = {"cpu": cpu_description(), "graphs": {file: plan.to_dict() for file, plan in plans.items()}}
    (directory / FORMS_FILE).write_text(json.dumps(written, indent=2) + "\n")
    return written


def _chosen(names: list[str], shape: list[int], rounds: dict[str, list[float]], int8: bool) -> FormChoice:
    medians = {name: statistics.median(times) * 1e3 for name, times in rounds.items()}
    spread = {name: (max(times) - min(times)) * 1e3 for name, times in rounds.items()}
    default = default_choice(shape, int8)
    fastest = min(medians, key=medians.get)
    lead = medians[default] - medians[fastest]
    noisy = fastest != default and spread[fastest] > lead
    return FormChoice(names, shape, {k: round(v, 3) for k, v in medians.items()},
                      {k: round(v, 3) for k, v in spread.items()}, default if noisy else fastest, noisy)


def _products(module: nn.Module, form: str) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The (weight, bias) products of ``module`` in ``form``, as the serving forms hold them."""
    if form == "merged":
        layers = [merged_form(module)]
    elif form == "pair":
        pair = pair_form(module)
        layers = [pair.first, pair.second]
    else:
        weight, bias = ((module.gated_weight(), module.bias) if isinstance(module, PrunedLinear)
                        else dense_weight_of(module))
        layers = [linear_of(weight.detach(), bias)]
    return [(_array(layer.weight), None if layer.bias is None else _array(layer.bias)) for layer in layers]


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


def _chain(modules: list[nn.Module], form: str) -> list[ChainLayer]:
    """``CHAIN_DEPTH`` layers of ``modules`` (repeated where the group is smaller) in ``form``."""
    width = _inputs(modules[0])
    generator = torch.Generator().manual_seed(TIMING_SEED)
    chain = []
    for index in range(CHAIN_DEPTH):
        products = _products(modules[index % len(modules)], form)
        outputs = products[-1][0].shape[0]
        back = None
        if outputs != width:
            weight = torch.randn(width, outputs, generator=generator) / outputs ** 0.5
            back = (_array(weight), np.zeros(width, np.float32))
        chain.append(ChainLayer(products, back))
    return chain


def _inputs(module: nn.Module) -> int:
    return module.in_features if isinstance(module, TTLinear) else dense_weight_of(module)[0].shape[1]


