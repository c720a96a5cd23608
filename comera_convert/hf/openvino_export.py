"""OpenVINO graphs of a compressed checkpoint, where sentence-transformers' ``backend="openvino"`` looks.

The model is exported to ONNX as ``onnx_export.py`` exports it (checked against PyTorch), and
OpenVINO converts that graph: ``openvino/openvino_model.xml`` with its weights beside it in
``openvino_model.bin``, the layout optimum-intel saves. With ``quantize="int8"``,
``openvino/openvino_model_qint8_quantized.xml`` as sentence-transformers'
``export_static_quantized_openvino_model`` makes it: NNCF's static post-training quantization for
transformers (weights and activations int8), calibrated on text; here the training split of the
package's english corpus, so that no data set is downloaded. Each graph is run by OpenVINO on the
tokenized sample and compared with PyTorch before anything is moved into place: the float graph in
float32 (OpenVINO computes in bfloat16 by default where the CPU has it), the int8 one as it serves.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from ..progress import Progress, no_progress
from ..text import training_documents
from .onnx_export import TOLERANCE, eager_attention, reference_outputs, relative_error, write_graphs

OPENVINO_FOLDER = "openvino"  # where sentence-transformers and optimum-intel look for OpenVINO graphs
OPENVINO_FILE = "openvino_model.xml"
INT8_FILE = "openvino_model_qint8_quantized.xml"  # sentence-transformers' name for its static int8 export
CALIBRATION_SOURCE = "english"
CALIBRATION_TEXTS = 128  # the samples sentence-transformers' OpenVINO export collects statistics on
CALIBRATION_TOKENS = 256  # the longest text MiniLM and MPNet sentence models embed
EXACT = {"INFERENCE_PRECISION_HINT": "f32"}  # the float graph checked in float32, not the bf16 OpenVINO may pick


def openvino_installed() -> bool:
    try:
        import nncf  # noqa: F401
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def require_openvino(what: str) -> None:
    """Refuse ``what`` in one line naming the extra where OpenVINO or NNCF is not installed."""
    if not openvino_installed():
        raise ConfigError(f"{what} needs openvino and nncf: pip install 'comera-convert[openvino]'")


def write_openvino_graphs(model: torch.nn.Module, tokenizer, directory: Path, *, opset: int, quantize: str | None,
                          progress: Progress = no_progress):
    """Write ``model``'s OpenVINO graph to ``directory/openvino_model.xml`` and, with ``quantize``, the int8
    graph; each checked against PyTorch on the tokenized sample. Returns the export's record
    (``onnx_export.OnnxExport``) with these graphs; exported with plain attention, as the ONNX graph is
    (``onnx_export.eager_attention``)."""
    with eager_attention(model):
        return _write_openvino_graphs(model, tokenizer, directory, opset, quantize, progress)


def _write_openvino_graphs(model, tokenizer, directory: Path, opset: int, quantize, progress):
    import openvino

    reference = reference_outputs(model, tokenizer)
    with tempfile.TemporaryDirectory(prefix="comera-openvino-") as folder:
        result = write_graphs(model, tokenizer, Path(folder), opset=opset, progress=progress)
        progress("converting to OpenVINO")
        graph = openvino.convert_model(str(result.graphs[0]))
    file = directory / OPENVINO_FILE
    openvino.save_model(graph, str(file), compress_to_fp16=False)
    result.max_difference = _check_float(file, reference)
    result.graphs, result.checked_by = [file], "OpenVINO"
    if quantize:
        progress(f"quantizing to int8 on {CALIBRATION_TEXTS} texts of the {CALIBRATION_SOURCE} corpus")
        quantized = directory / INT8_FILE
        tokens = min(CALIBRATION_TOKENS, getattr(model.config, "max_position_embeddings", CALIBRATION_TOKENS))
        openvino.save_model(quantize_static(graph, tokenizer, tokens), str(quantized), compress_to_fp16=False)
        result.int8_difference = _check_int8(quantized, reference)
        result.graphs.append(quantized)
    return result


def quantize_static(graph, tokenizer, tokens: int = CALIBRATION_TOKENS):
    """``graph`` with int8 weights and activations by NNCF's post-training quantization for transformers,
    calibrated on the training split of the package's english corpus, each text cut to ``tokens``."""
    import nncf

    names = [port.get_any_name() for port in graph.inputs]
    texts = list(islice(training_documents(CALIBRATION_SOURCE), CALIBRATION_TEXTS))
    samples = [tokenizer([text], truncation=True, max_length=tokens, return_tensors="np")
               for text in texts]
    dataset = nncf.Dataset(samples, lambda encoded: {name: _input(encoded, name) for name in names})
    with _quiet_nncf():
        return nncf.quantize(graph, dataset, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(samples))


def run_graph(compiled, feeds: dict) -> np.ndarray:
    """The compiled graph's first output on ``feeds`` (numpy arrays by input name; token type ids as zeros
    where the graph takes them and none are given)."""
    return compiled({port.get_any_name(): _input(feeds, port.get_any_name()) for port in compiled.inputs})[0]


def compile_graph(file, config: dict | None = None):
    """``file`` compiled for this machine's CPU, answering one request at a time with all its cores (what
    optimum-intel asks of OpenVINO by default)."""
    import openvino

    return openvino.Core().compile_model(str(file), "CPU", {"PERFORMANCE_HINT": "LATENCY", **(config or {})})


def _input(encoded, name: str) -> np.ndarray:
    if name == "token_type_ids" and name not in encoded:
        return np.zeros_like(np.asarray(encoded["input_ids"]))
    return np.asarray(encoded[name])


def _check_float(file: Path, reference) -> float:
    got = torch.from_numpy(run_graph(compile_graph(file, EXACT), _numpy(reference.sample)))
    difference = float((got.float() - reference.expected.float()).abs().max())
    scale = float(reference.expected.float().abs().max()) or 1.0
    if not difference <= TOLERANCE[torch.float32] * scale:
        raise ConfigError(f"the OpenVINO graph disagrees with PyTorch: largest difference {difference:.3g} against "
                          f"outputs up to {scale:.3g}; nothing was written")
    return difference


def _check_int8(file: Path, reference) -> float:
    got = torch.from_numpy(run_graph(compile_graph(file), _numpy(reference.sample)))
    return relative_error(got, reference.expected, "the OpenVINO int8 graph")


def _numpy(sample: dict) -> dict:
    return {name: value.numpy() for name, value in sample.items()}


@contextlib.contextmanager
def _quiet_nncf():
    """NNCF draws progress bars and logs each step; the export reports its own progress."""
    logger = logging.getLogger("nncf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
