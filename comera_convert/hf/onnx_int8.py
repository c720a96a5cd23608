"""int8 ONNX graphs as sentence-transformers makes them: dynamic quantization by onnxruntime.

sentence-transformers' ``export_dynamic_quantized_onnx_model(model, "avx512_vnni", ...)`` runs optimum's
``ORTQuantizer`` with one of four per-architecture configurations, and optimum hands them to
onnxruntime's ``quantize_dynamic``: weights int8 per output channel (uint8 on ``avx2``), activations
uint8, quantized as they come, full range, every operator onnxruntime has an integer kernel for. The
same call here quantizes a compressed graph exactly as the dense model's export is quantized, without
optimum, and names the file as sentence-transformers does (``model_qint8_<arch>.onnx``,
``model_quint8_avx2.onnx``), so that
``SentenceTransformer(path, backend="onnx", model_kwargs={"file_name": "onnx/model_qint8_avx512_vnni.onnx"})``
finds it.

A compressed graph first goes through ``prepare_for_int8``: the exporter writes many factors as
initializers reshaped or gated inside the graph, and onnxruntime's dynamic quantization takes only
products whose weight is an initializer, so most of MiniLM's factors would stay float. Folding the
constants (onnxruntime's basic, hardware-independent optimizations, saved) and writing each
constant-weight ``Gemm`` as ``MatMul`` + ``Add`` (which older quantizers leave float) computes the same
and lets every factor be quantized.
"""

from __future__ import annotations

import logging
import platform
import tempfile
from pathlib import Path

from ..errors import ConfigError, expected
from ..machine import cpu_features

# The architectures sentence-transformers names its int8 files after, most capable first, and the
# weight type each one's kernels take (avx2's integer GEMM multiplies unsigned weights).
WEIGHT_TYPES = {"avx512_vnni": "QInt8", "avx512": "QInt8", "avx2": "QUInt8", "arm64": "QInt8"}
ARCHES = tuple(WEIGHT_TYPES)
# x86 without VNNI: an int8 product sums unsigned-by-signed byte pairs in 16 bits, which full-range
# weights can overflow.
SATURATING_ARCHES = ("avx512", "avx2")


def int8_file_name(arch: str) -> str:
    """The file name sentence-transformers gives an int8 graph for ``arch``: its weights' type, then ``arch``
    (``model_quint8_avx2.onnx``, ``model_qint8_avx512_vnni.onnx``)."""
    return f"model_{WEIGHT_TYPES[check_arch(arch)].lower()}_{arch}.onnx"


def check_arch(arch: str) -> str:
    if arch not in WEIGHT_TYPES:
        raise ConfigError(f"--arch: {expected('one of ' + ', '.join(ARCHES), arch)}")
    return arch


def this_machine_arch() -> str:
    """The most capable of ``ARCHES`` this CPU runs: arm64 on ARM, else read from the CPU's flags
    (``machine.cpu_features``; avx2 where they cannot be read)."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64"
    features = cpu_features()
    if "avx512_vnni" in features:
        return "avx512_vnni"
    return "avx512" if "avx512f" in features else "avx2"


def require_onnxruntime(what: str) -> None:
    """Refuse ``what`` in one line naming the extra where onnxruntime is not installed."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs onnxruntime: pip install 'comera-convert[onnx]'") from None


def quantize_int8(source: Path, target: Path, arch: str, prepare: bool = True, float_layers=()) -> None:
    """Write ``source``'s graph with int8 weights to ``target``, quantized as sentence-transformers' export
    for ``arch`` is; ``prepare`` first folds it so that every weight can be (``prepare_for_int8``). The
    products of ``float_layers`` (module names of the exported model) stay float."""
    excluded = layer_nodes(source, float_layers) if float_layers else []
    with tempfile.TemporaryDirectory(prefix="comera-int8-") as folder:
        if prepare and not external_data(source):  # the prepared graph is saved whole: below 2 GB
            source = prepare_for_int8(source, Path(folder) / "prepared.onnx")
        _quantize_dynamic(source, target, arch, excluded)


NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # torch's exporter: the module path of each node, as a list


def layer_nodes(file: Path, layers) -> list[str]:
    """The products (MatMul, Gemm) in ``file`` that torch's exporter made of modules ``layers`` or their
    children, by node name (as ``MainOutput`` holds the model: under ``model.``); a Gemm under the name
    ``prepare_for_int8`` gives its MatMul too."""
    import ast

    import onnx

    wanted = {f"model.{layer}" for layer in layers}
    names = []
    for node in onnx.load(str(file), load_external_data=False).graph.node:
        scopes = next((ast.literal_eval(p.value) for p in node.metadata_props if p.key == NAME_SCOPES), [])
        if node.op_type in ("MatMul", "Gemm") and wanted.intersection(scopes):
            names += [node.name, f"{node.name}_matmul"] if node.op_type == "Gemm" else [node.name]
    return names


def prepare_for_int8(source: Path, target: Path) -> Path:
    """``source`` with its constants folded and each constant-weight Gemm written as MatMul + Add (module
    docstring), saved to ``target``."""
    import onnx
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(target)
    onnxruntime.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    model = onnx.load(str(target))
    _gemm_as_matmul(model.graph)
    onnx.save(model, str(target))
    return target


def _gemm_as_matmul(graph) -> None:
    """Rewrite every ``Gemm(x, W, b)`` with an initializer W, no transposed x and unit scales as
    ``MatMul(x, W or W^T) + b`` in place."""
    from onnx import helper, numpy_helper

    weights = {tensor.name: tensor for tensor in graph.initializer}
    nodes = []
    for node in graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = (node.op_type == "Gemm" and node.input[1] in weights and not attributes.get("transA", 0)
                 and attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0)
        if not plain:
            nodes.append(node)
            continue
        weight = node.input[1]
        if attributes.get("transB", 0):
            transposed = numpy_helper.to_array(weights[weight]).T.copy()
            weight = f"{weight}_transposed"
            graph.initializer.append(numpy_helper.from_array(transposed, weight))
        has_bias = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}_product" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], weight], [product], name=f"{node.name}_matmul"))
        if has_bias:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_bias"))
    del graph.node[:]
    graph.node.extend(nodes)


def external_data(file: Path) -> list[Path]:
    """The files beside a graph holding its weights (torch's exporter names them ``model.onnx.data``,
    optimum ``model.onnx_data``)."""
    return [p for p in file.parent.iterdir() if p.name.startswith(file.name + ".") or p.name == file.name + "_data"]


def _quantize_dynamic(source: Path, target: Path, arch: str, excluded: list[str] = ()) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quiet = logging.getLogger()  # onnxruntime suggests its pre-processing on the root logger
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        quantize_dynamic(str(source), str(target), per_channel=True, reduce_range=False,
                         weight_type=getattr(QuantType, WEIGHT_TYPES[check_arch(arch)]),
                         nodes_to_exclude=list(excluded))
    finally:
        quiet.setLevel(level)
