"""OpenVINO graphs of a compressed checkpoint, where sentence-transformers' ``backend="openvino"`` looks.

The model, each compressed layer in its serving form (``layers/serving_forms.py``: a low-rank pair as two
linears or as their product, whichever ``form_timing.py`` measured faster here), is converted by OpenVINO's
PyTorch frontend, as optimum-intel converts a dense model (attention as OpenVINO's fused scaled-dot-product
operation): ``openvino/openvino_model.xml`` with its weights beside it in ``openvino_model.bin``, the layout
optimum-intel saves, and the forms chosen in ``serving_forms.json``. With ``quantize="int8"``,
``openvino/openvino_model_qint8_quantized.xml`` as sentence-transformers'
``export_static_quantized_openvino_model`` makes it: NNCF's static post-training quantization for
transformers (weights and activations int8), calibrated on text; here the training split of the
package's english corpus, so that no data set is downloaded; on a CPU without VNNI, whose int8 products
sum pairs in 16 bits, every layer's weights are kept to 7 bits (NNCF's overflow fix) so that the sums
cannot saturate. Each graph is run by OpenVINO on the
tokenized sample and compared with PyTorch before anything is moved into place: the float graph in
float32 (OpenVINO computes in bfloat16 by default where the CPU has it), the int8 one as it serves.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from itertools import islice
from pathlib import Path

import torch

from ..errors import ConfigError
from ..progress import Progress, no_progress
from ..text import training_documents
from ..layers.serving_forms import serving_copy
from .form_timing import FormPlan, plan_forms, write_plans
from .onnx_int8 import SATURATING_ARCHES, this_machine_arch
from .runtimes import compile_graph, graph_input, quiet_nncf, run_graph
from .onnx_export import TOLERANCE, MainOutput, OnnxExport, reference_outputs, relative_error

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


def write_openvino_graphs(model: torch.nn.Module, tokenizer, directory: Path, *, quantize: str | None,
                          forms: str = "auto", progress: Progress = no_progress):
    """Write ``model``'s OpenVINO graph to ``directory/openvino_model.xml`` and, with ``quantize``, the int8
    graph; each checked against PyTorch on the tokenized sample. ``forms``: each low-rank pair's serving form
    and each layer's precision, timed on this machine (``"auto"``, ``form_timing.py``) or one form for every
    pair with every layer in int8; the plans are written beside the graphs (``FORMS_FILE``). Returns the
    export's record (``onnx_export.OnnxExport``) with these graphs."""
    import openvino

    reference = reference_outputs(model, tokenizer)
    plans = {OPENVINO_FILE: plan_forms(model, "openvino", False, forms, progress=progress)}
    graph = frontend_graph(model, plans[OPENVINO_FILE], reference.sample, progress, reference.output_name)
    file = directory / OPENVINO_FILE
    openvino.save_model(graph, str(file), compress_to_fp16=False)
    result = OnnxExport(out=directory, output_name=reference.output_name, opset=None, graphs=[file],
                        max_difference=_check_float(file, reference), checked_by="OpenVINO")
    if quantize:
        plans[INT8_FILE] = plan = plan_forms(model, "openvino", True, forms, progress=progress)
        if plan.forms() != plans[OPENVINO_FILE].forms():
            graph = frontend_graph(model, plan, reference.sample, progress, reference.output_name)
        progress(f"quantizing to int8 on {CALIBRATION_TEXTS} texts of the {CALIBRATION_SOURCE} corpus")
        quantized = directory / INT8_FILE
        tokens = min(CALIBRATION_TOKENS, getattr(model.config, "max_position_embeddings", CALIBRATION_TOKENS))
        openvino.save_model(quantize_static(graph, tokenizer, tokens, float_layers=plan.float_layers()),
                            str(quantized), compress_to_fp16=False)
        result.int8_difference = _check_int8(quantized, reference)
        result.graphs.append(quantized)
    result.forms = write_plans(plans, directory)
    return result


def frontend_graph(model: torch.nn.Module, plan: FormPlan, sample: dict, progress: Progress = no_progress,
                   output_name: str | None = None):
    """``model`` in its serving forms (``plan``), converted by OpenVINO's PyTorch frontend as optimum-intel
    converts a dense model: traced on ``sample``, inputs of any batch and length, attention written as
    scaled-dot-product attention (OpenVINO's fused operation) where the architecture has it; its output
    named ``output_name``, the name optimum-intel reads it by (``last_hidden_state`` for an encoder)."""
    import openvino

    progress("converting to OpenVINO (PyTorch frontend)")
    served = serving_copy(model, plan.forms())
    with contextlib.suppress(ValueError, ImportError, AttributeError):  # an architecture without it: as it is
        served.set_attn_implementation("sdpa")
    with warnings.catch_warnings():  # the tracer warns of every shape it reads as a constant
        warnings.simplefilter("ignore")
        graph = openvino.convert_model(MainOutput(served), example_input=sample)
    if output_name:
        graph.outputs[0].get_tensor().set_names({output_name})
    return graph


def quantize_static(graph, tokenizer, tokens: int = CALIBRATION_TOKENS, float_layers=()):
    """``graph`` with int8 weights and activations by NNCF's post-training quantization for transformers,
    calibrated on the training split of the package's english corpus, each text cut to ``tokens``; the
    linears of ``float_layers`` (module names) are left in float."""
    import nncf

    names = [port.get_any_name() for port in graph.inputs]
    texts = list(islice(training_documents(CALIBRATION_SOURCE), CALIBRATION_TEXTS))
    samples = [tokenizer([text], truncation=True, max_length=tokens, return_tensors="np")
               for text in texts]
    dataset = nncf.Dataset(samples, lambda encoded: {name: graph_input(encoded, name) for name in names})
    ignored = nncf.IgnoredScope(patterns=[layer_pattern(name) for name in float_layers], validate=False)
    with quiet_nncf():
        return nncf.quantize(graph, dataset, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(samples),
                             ignored_scope=ignored, advanced_parameters=overflow_fix(this_machine_arch()))


def overflow_fix(arch: str):
    """NNCF's parameters for a CPU of ``arch`` (``onnx_int8.ARCHES``): the overflow fix on every layer where
    its int8 products can saturate (``SATURATING_ARCHES``; a tiny BERT's int8 outputs move by a twentieth there
    with full-range weights, by under a hundredth with 7-bit ones), else NNCF's defaults (None)."""
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

    return AdvancedQuantizationParameters(overflow_fix=OverflowFix.ENABLE) if arch in SATURATING_ARCHES else None


def layer_pattern(name: str) -> str:
    """The pattern of the graph nodes the PyTorch frontend makes of module ``name`` of the exported model
    (``MainOutput`` holds it as ``model``): its own and, for a pair, its two linears'."""
    return rf"__module\.model\.{re.escape(name)}(\.first|\.second)?/.*"


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
