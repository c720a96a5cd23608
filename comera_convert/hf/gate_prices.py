"""What time costs where the model will serve: the prices a speed target's budget closes gates by, and the speed
of a whole model against its dense source's fastest form.

A gate entry's price is the time one open entry costs a batch of the serving shape: a rank of a low-rank pair
(the two products through its bond, ``PairPrice``) or a hidden neuron of a pruned feed-forward pair (its row
of ``up``, the gelu on it and its column of ``down``, ``NeuronPrice``). Each is measured in the runtime, in
int8 as the model will serve there, as the slope of a chain's time (``chain_timing.py``) between the layer at
its rank and at half of it, so that what a layer costs whatever its width (the quantization of its input, the
norm around it) is left out. Prices are taken in int8, as the compressed model serves fastest in each runtime
(OpenVINO's and ONNX Runtime's int8 graphs, ``use_int8_compute`` in torch). Prices are kept in microseconds a
batch: budgets count in whole units.

A whole model is timed as it serves: exported in the runtime (``onnx_export``, ``openvino_export``, or eager
torch), each of its forms (float and int8) on one batch of token ids of the serving shape, the forms taking
turns for the rounds; its time is its fastest form's. The dense source is timed the same way in the same
rounds, so that a speed is a ratio within one run.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..choices import SPEED_RUNTIMES
from ..errors import ConfigError, expected
from ..layers import use_int8_compute
from .chain_timing import CHAIN_DEPTH, TIMERS, ChainLayer, timed_rounds
from .form_timing import SERVING_SHAPE
from .onnx_export import write_graphs
from .onnx_int8 import require_onnxruntime, this_machine_arch
from .openvino_export import require_openvino, write_openvino_graphs
from .runtimes import compile_graph, run_graph

PRICE_ROUNDS = 9  # rounds of each chain: the quartiles of nine give the spread a price is tested against
MODEL_ROUNDS = 5
MICROSECONDS = 1e6
TOKEN_IDS = (1000, 2000)  # the timed batch's token ids are drawn from this range (any word's: lookups cost alike)


@dataclass(frozen=True)
class PairPrice:
    """A rank of a low-rank pair ``inputs -> rank -> outputs``."""

    inputs: int
    outputs: int
    rank: int


@dataclass(frozen=True)
class NeuronPrice:
    """A hidden neuron of a pruned feed-forward pair ``width -> neurons -> width``."""

    width: int
    neurons: int


class TooNoisy(ConfigError):
    """Timing on this machine scatters more than the differences it must tell apart."""


def require_runtime(runtime: str, what: str) -> None:
    """Refuse ``runtime`` in one line where it is unknown, or not installed (naming the extra)."""
    if runtime not in SPEED_RUNTIMES:
        raise ConfigError(f"--runtime: {expected('one of ' + ', '.join(SPEED_RUNTIMES), runtime)}")
    if runtime == "openvino":
        require_openvino(what)
    elif runtime == "onnx":
        require_onnxruntime(what)


def entry_prices(keys: list, runtime: str, shape: tuple[int, int] = SERVING_SHAPE,
                 rounds: int = PRICE_ROUNDS) -> dict:
    """Microseconds a batch of ``shape`` that one open entry costs, for each distinct key (``PairPrice``,
    ``NeuronPrice``) of ``keys``; raises ``TooNoisy`` where a chain's spread hides its slope."""
    prices = {}
    for key in dict.fromkeys(keys):
        full, half = _chain_of(key, 1.0), _chain_of(key, 0.5)
        width = key.inputs if isinstance(key, PairPrice) else key.width
        timer = TIMERS[runtime]
        times = timed_rounds({"full": timer(full, True, width, shape), "half": timer(half, True, width, shape)},
                             rounds)
        saved = statistics.median(times["full"]) - statistics.median(times["half"])
        spread = _quartile_spread(times["full"]) + _quartile_spread(times["half"])
        units = _units(key) - _units(key, 0.5)
        if saved <= spread:
            raise TooNoisy(f"--target-speedup: timing on this machine is too noisy to price the gates: halving "
                           f"{_describe(key)} saved {saved * 1e3:.3f} ms a chain, less than the spread of the "
                           f"repeats ({spread * 1e3:.3f} ms); measure on a quieter machine, or give --target-ratio")
        prices[key] = saved / (CHAIN_DEPTH * units) * MICROSECONDS
    return prices


def _units(key, share: float = 1.0) -> int:
    return max(1, round((key.rank if isinstance(key, PairPrice) else key.neurons) * share))


def _describe(key) -> str:
    if isinstance(key, PairPrice):
        return f"the rank of a {key.inputs}x{key.rank}x{key.outputs} pair"
    return f"the neurons of a {key.width}x{key.neurons} feed-forward pair"


def _quartile_spread(times: list[float]) -> float:
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return quartiles[2] - quartiles[0]


def _chain_of(key, share: float) -> list[ChainLayer]:
    """A chain of ``CHAIN_DEPTH`` layers of ``key``'s shape at ``share`` of its units (random weights: a
    product's time does not depend on its values)."""
    generator = torch.Generator().manual_seed(0)
    units = _units(key, share)

    def weight(outputs: int, inputs: int) -> np.ndarray:
        return (torch.randn(outputs, inputs, generator=generator) / inputs ** 0.5).numpy()

    if isinstance(key, PairPrice):
        layer = lambda: ChainLayer([(weight(units, key.inputs), None),  # noqa: E731
                                    (weight(key.outputs, units), np.zeros(key.outputs, np.float32))],
                                   back=None if key.outputs == key.inputs else
                                   (weight(key.inputs, key.outputs), np.zeros(key.inputs, np.float32)))
    else:
        layer = lambda: ChainLayer([(weight(units, key.width), np.zeros(units, np.float32)),  # noqa: E731
                                    (weight(key.width, units), np.zeros(key.width, np.float32))],
                                   gelu_between=True)
    return [layer() for _ in range(CHAIN_DEPTH)]


# -- whole models -------------------------------------------------------------------------------------
def timing_inputs(config=None, shape: tuple[int, int] = SERVING_SHAPE) -> dict[str, torch.Tensor]:
    """One batch of token ids of ``shape``, every token attended to: no longer than ``config``'s model embeds,
    its ids within its vocabulary."""
    tokens = min(shape[1], getattr(config, "max_position_embeddings", shape[1]) - 2)
    high = min(TOKEN_IDS[1], getattr(config, "vocab_size", TOKEN_IDS[1]))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(TOKEN_IDS[0], high - 1), high, (shape[0], tokens), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}


def model_forms(model: nn.Module, tokenizer, runtime: str, compressed: bool, folder: Path) -> dict[str, Callable]:
    """Each form ``model`` serves in within ``runtime`` (float and int8) as a call on ``timing_inputs``: the
    graphs are written into ``folder``; a compressed model's layers two products through each bond (its
    plan's default; ``comera export`` then times the forms)."""
    batch = timing_inputs(getattr(model, "config", None))
    forms = "pair"
    if runtime == "torch":
        int8 = copy.deepcopy(model)
        if compressed:
            use_int8_compute(int8)
        else:
            with warnings.catch_warnings():  # torch announces the eager quantization API's move to torchao
                warnings.simplefilter("ignore")
                int8 = torch.ao.quantization.quantize_dynamic(int8, {nn.Linear}, dtype=torch.qint8)
        return {name: _torch_call(m, batch) for name, m in (("float32", model), ("int8", int8))}
    if runtime == "onnx":
        import onnxruntime

        graphs = write_graphs(model, tokenizer, folder, quantize="int8", arch=this_machine_arch(), forms=forms,
                              prepare=compressed).graphs
        sessions = [onnxruntime.InferenceSession(str(g), providers=["CPUExecutionProvider"]) for g in graphs]
        return {name: _onnx_call(session, batch) for name, session in zip(("float32", "int8"), sessions)}
    graphs = write_openvino_graphs(model, tokenizer, folder, quantize="int8", forms=forms).graphs
    feeds = {name: value.numpy() for name, value in batch.items()}
    return {name: (lambda compiled=compile_graph(graph): run_graph(compiled, feeds))
            for name, graph in zip(("default precision", "int8"), graphs)}


def _torch_call(model: nn.Module, batch: dict) -> Callable:
    def run():
        with torch.inference_mode():
            model(**batch)
    return run


def _onnx_call(session, batch: dict) -> Callable:
    feeds = {i.name: batch[i.name].numpy() for i in session.get_inputs()}
    return lambda: session.run(None, feeds)


@dataclass
class ServingSpeed:
    """A compressed model's speed against its dense source in one runtime, timed in the same rounds."""

    runtime: str
    speedup: float  # the dense model's fastest form's time over the compressed model's fastest form's
    speedup_error: float  # standard error of the rounds' ratios
    dense_form: str
    dense_microseconds: float  # a batch, the dense model's fastest form
    form: str
    microseconds: float  # a batch, the compressed model's fastest form

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def fastest_forms(models: dict[str, tuple[nn.Module, bool]], tokenizer, runtime: str,
                  rounds: int = MODEL_ROUNDS) -> dict[str, tuple[str, list[float]]]:
    """Each of ``models`` (name: (model, whether compressed)) in each of its forms in ``runtime``, every form of
    every model timed in the same rounds; for each model its fastest form's name and its rounds' seconds."""
    with tempfile.TemporaryDirectory(prefix="comera-speed-") as folder:
        calls = {}
        for name, (model, compressed) in models.items():
            directory = Path(folder) / f"model-{len(calls)}"
            directory.mkdir()
            calls.update({(name, form): call for form, call in
                          model_forms(model, tokenizer, runtime, compressed, directory).items()})
        times = timed_rounds(calls, rounds)
    fastest = {}
    for name in models:
        key = min((key for key in times if key[0] == name), key=lambda k: statistics.median(times[k]))
        fastest[name] = (key[1], times[key])
    return fastest


def serving_speed(model: nn.Module, dense: nn.Module, tokenizer, runtime: str,
                  rounds: int = MODEL_ROUNDS) -> ServingSpeed:
    """``model``'s speed against ``dense``, each in its fastest form in ``runtime``, timed in the same rounds."""
    timed = fastest_forms({"dense": (dense, False), "comera": (model, True)}, tokenizer, runtime, rounds)
    (dense_form, dense_times), (form, times) = timed["dense"], timed["comera"]
    ratios = [d / m for d, m in zip(dense_times, times)]
    error = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    return ServingSpeed(runtime, statistics.median(ratios), error, dense_form,
                        statistics.median(dense_times) * MICROSECONDS, form, statistics.median(times) * MICROSECONDS)
