"""Timing a layer where it will serve: a chain of its products in the runtime (OpenVINO, ONNX Runtime or
torch), built from the weights alone, so that it compiles in milliseconds.

A chain is ``CHAIN_DEPTH`` layers ``x -> norm(x + layer(x))`` (a layer that changes the width is followed
by a gelu and a product back to it), the way a transformer block wraps its linears, on one batch of the
serving shape: enough that the graph's own input and output are not what is timed. Every candidate of a
comparison runs once a round, in turn, so that the machine's drift meets them alike (``timed_rounds``).
``form_timing.py`` chooses forms with it, ``gate_prices.py`` prices the gates of a speed target.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..layers.serving_forms import linear_of
from .onnx_int8 import quantize_int8, this_machine_arch
from .runtimes import compile_graph, quiet_nncf

TIMING_SEED = 0
CHAIN_DEPTH = 4  # layers per timed graph: enough that the graph's own input and output are not what is timed


def timed_rounds(runners: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    for run in runners.values():  # warm-up: the first call packs weights and allocates
        run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


@dataclass
class ChainLayer:
    """One layer of a timed chain: its products in turn, each a float32 (outputs x inputs) weight and a bias
    or None (``gelu_between``: a gelu after the first, as between a feed-forward pair's two layers), and where
    it changes the width, a gelu and the product back to it."""

    products: list[tuple[np.ndarray, np.ndarray | None]]
    back: tuple[np.ndarray, np.ndarray] | None = None
    gelu_between: bool = False

    def steps(self) -> list[tuple[bool, tuple]]:
        """(gelu before it, product) for each product in turn, the product back included."""
        products = self.products + ([self.back] if self.back is not None else [])
        return [((index == 1 and self.gelu_between) or (self.back is not None and index == len(products) - 1),
                 product) for index, product in enumerate(products)]


def timing_batch(width: int, shape: tuple[int, int]) -> np.ndarray:
    generator = torch.Generator().manual_seed(TIMING_SEED)
    return torch.randn(*shape, width, generator=generator).numpy()


def _openvino_graph(chain: list[ChainLayer], width: int):
    """The chain as an OpenVINO model, built from its operations (as the PyTorch frontend writes a linear:
    a product by the transposed weight, then the bias; a layer norm as MVN, scale and shift)."""
    import openvino

    ops = _openvino_ops()
    x = ops.parameter([-1, -1, width], np.float32, name="x")
    hidden = x
    for layer in chain:
        y = hidden
        for gelu, (weight, bias) in layer.steps():
            y = ops.matmul(ops.gelu(y, "erf") if gelu else y, ops.constant(weight), False, True)
            y = y if bias is None else ops.add(y, ops.constant(bias))
        normed = ops.mvn(ops.add(hidden, y), ops.constant(np.array([-1], np.int64)), True, 1e-12, "inside_sqrt")
        hidden = ops.add(ops.multiply(normed, ops.constant(np.ones(width, np.float32))),
                         ops.constant(np.zeros(width, np.float32)))
    return openvino.Model([hidden], [x], "chain")


def _openvino_ops():
    try:
        import openvino.opset13 as ops
    except ImportError:  # openvino before 2025 keeps its operation sets under openvino.runtime
        import openvino.runtime.opset13 as ops
    return ops


def _openvino_timer(chain: list[ChainLayer], int8: bool, width: int, shape: tuple[int, int]) -> Callable[[], None]:
    graph = _openvino_graph(chain, width)
    example = timing_batch(width, shape)
    if int8:
        import nncf
        from nncf.quantization.advanced_parameters import (AdvancedQuantizationParameters,
                                                           AdvancedSmoothQuantParameters)

        # The quantizers where the model's graph gets them; smoothing and bias correction change values, not
        # what runs, and are left out of a graph that is only timed.
        untuned = AdvancedQuantizationParameters(smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1),
                                                 disable_bias_correction=True)
        with quiet_nncf():
            graph = nncf.quantize(graph, nncf.Dataset([example[:1]]), model_type=nncf.ModelType.TRANSFORMER,
                                  subset_size=1, fast_bias_correction=True, advanced_parameters=untuned)
    compiled = compile_graph(graph)
    return lambda: compiled(example)


def _onnx_graph(chain: list[ChainLayer], width: int):
    """The chain as an ONNX model (opset 17), linears as torch's exporter writes them: MatMul by the
    transposed weight, then Add; gelu as its erf form; layer norm as LayerNormalization."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, weights = [], []

    def constant(value: np.ndarray) -> str:
        name = f"c{len(weights)}"
        weights.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(op: str, *inputs: str, **attributes) -> str:
        output = f"t{len(nodes)}"
        nodes.append(helper.make_node(op, list(inputs), [output], **attributes))
        return output

    def gelu(y: str) -> str:
        half, root, one = (constant(np.float32(value)) for value in (0.5, 2 ** -0.5, 1.0))
        return node("Mul", node("Mul", y, half), node("Add", node("Erf", node("Mul", y, root)), one))

    hidden = "x"
    scale, shift = constant(np.ones(width, np.float32)), constant(np.zeros(width, np.float32))
    for layer in chain:
        y = hidden
        for before, (weight, bias) in layer.steps():
            y = node("MatMul", gelu(y) if before else y, constant(weight.T))
            y = y if bias is None else node("Add", y, constant(bias))
        hidden = node("LayerNormalization", node("Add", hidden, y), scale, shift, axis=-1, epsilon=1e-12)
    graph = helper.make_graph(nodes, "chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, width])],
                              [helper.make_tensor_value_info(hidden, TensorProto.FLOAT, None)], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _onnx_timer(chain: list[ChainLayer], int8: bool, width: int, shape: tuple[int, int]) -> Callable[[], None]:
    import onnx
    import onnxruntime

    example = timing_batch(width, shape)
    with tempfile.TemporaryDirectory(prefix="comera-forms-") as folder:
        file = Path(folder) / "chain.onnx"
        onnx.save(_onnx_graph(chain, width), str(file))
        if int8:
            quantized = Path(folder) / "chain-int8.onnx"
            quantize_int8(file, quantized, this_machine_arch(), prepare=False)
            file = quantized
        session = onnxruntime.InferenceSession(str(file), providers=["CPUExecutionProvider"])
    return lambda: session.run(None, {"x": example})


def _torch_timer(chain: list[ChainLayer], int8: bool, width: int, shape: tuple[int, int]) -> Callable[[], None]:
    """The chain as torch modules, eager; int8 by torch's dynamic quantization of its linears (fbgemm's
    kernels, as ``layers.use_int8_compute`` runs a pair's products)."""
    model = _TorchChain(chain, width).eval()
    if int8:
        with warnings.catch_warnings():  # torch announces the eager quantization API's move to torchao
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    example = torch.from_numpy(timing_batch(width, shape))

    def run():
        with torch.inference_mode():
            model(example)
    return run


class _TorchChain(nn.Module):
    def __init__(self, chain: list[ChainLayer], width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList(linear_of(torch.from_numpy(w), None if b is None else
                                                            torch.from_numpy(b)) for _, (w, b) in layer.steps())
                                    for layer in chain)
        self.gelus = [[gelu for gelu, _ in layer.steps()] for layer in chain]
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        for products, gelus in zip(self.layers, self.gelus):
            y = x
            for product, gelu in zip(products, gelus):
                y = product(nn.functional.gelu(y) if gelu else y)
            x = self.norm(x + y)
        return x


TIMERS = {"openvino": _openvino_timer, "onnx": _onnx_timer, "torch": _torch_timer}
