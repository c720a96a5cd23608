"""ONNX export of a compressed checkpoint: the model leaves Python, still compressed.

torch's exporter (``torch.onnx.export(dynamo=True)``) traces the TT contractions as they are, so
the graph holds the cores (or the two merged halves the optimizer folds them into), not dense
weights. The graphs go where sentence-transformers and optimum look for them, an ``onnx/`` folder:
``onnx/model.onnx`` (one file, its weights inside, below protobuf's 2 GB), and with ``quantize="int8"``
``onnx/model_qint8_<arch>.onnx`` (``model_quint8_avx2.onnx``) quantized as sentence-transformers quantizes a
dense model's export (``onnx_int8.py``); ``export.py`` puts them in place. Each graph is checked against PyTorch with
onnxruntime on a tokenized sample.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..layers.serving_forms import serving_copy
from ..progress import Progress, no_progress
from .form_timing import plan_forms, write_plans
from .onnx_int8 import external_data, int8_file_name, quantize_int8
from .runtimes import quiet_exporter

ONNX_FOLDER = "onnx"  # where sentence-transformers and optimum look for graphs
ONNX_FILE = "model.onnx"
# torch's exporter implements opset 18 and later; an earlier one goes through a version converter
# that, where it fails, silently keeps 18: refused instead.
MIN_OPSET = 18
DEFAULT_OPSET = 18
DTYPES = {"float32": torch.float32, "float16": torch.float16}
QUANTIZE = ("int8",)
# Largest |ONNX - PyTorch| accepted, relative to the largest |PyTorch| output, by dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}
# ||int8 graph - PyTorch|| / ||PyTorch|| of the hidden states. Beyond INT8_TOLERANCE the graph computes
# something else (an unrelated output of the same size strays by about the states' own norm): refused.
# Beyond INT8_NOTE rounding itself moved the states far, as dynamic int8 does to an encoder with outlier
# channels (sentence-transformers' own int8 export of all-mpnet-base-v2 among them, docs/findings.md):
# written, with a note to measure the retrieval before serving it.
INT8_TOLERANCE = 1.0
INT8_NOTE = 0.3
ONE_FILE_BYTES = 2 ** 31 - 2 ** 26  # protobuf's 2 GB limit on one file, less room for the graph itself
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")  # the graph's inputs, where the tokenizer gives them
SAMPLE_TEXTS = ["Tensor trains keep large models small.", "A second, longer sample sentence to pad the batch with."]


@dataclass
class OnnxExport:
    out: Path  # the folder holding onnx/
    output_name: str
    opset: int | None  # None: no ONNX graph on the way (OpenVINO converts the PyTorch module)
    max_difference: float | None  # None: onnxruntime was not there to check
    graphs: list[Path] = field(default_factory=list)  # the written graphs, float first
    int8_difference: float | None = None  # relative error of the int8 graph's hidden states
    checked_by: str = "onnxruntime"  # the runtime that ran the graphs against PyTorch
    notes: list[str] = field(default_factory=list)
    forms: dict | None = None  # the serving forms chosen per graph (form_timing.write_plans)


class MainOutput(nn.Module):
    """The model's main tensor only (logits, else the last hidden state): a graph with one output
    under a name serving code expects. Causal LMs run without their KV cache (a plain graph)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.use_cache = {"use_cache": False} if getattr(model.config, "use_cache", False) else {}

    @staticmethod
    def pick(out) -> tuple[str, torch.Tensor]:
        """(output name, tensor) of a transformers output."""
        logits = getattr(out, "logits", None)
        return ("logits", logits) if logits is not None else ("last_hidden_state", out.last_hidden_state)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        inputs = {"attention_mask": attention_mask, "token_type_ids": token_type_ids}
        inputs = {name: value for name, value in inputs.items() if value is not None}
        return self.pick(self.model(input_ids=input_ids, **inputs, **self.use_cache))[1]


def write_graphs(model: nn.Module, tokenizer, directory: Path, *, opset: int = DEFAULT_OPSET,
                 quantize: str | None = None, arch: str | None = None, prepare: bool = True, forms: str = "auto",
                 progress: Progress = no_progress) -> OnnxExport:
    """Write ``model``'s graph (in its dtype) to ``directory/model.onnx`` and, with ``quantize``, the int8 graph
    for ``arch``, each checked against PyTorch on a tokenized sample; ``prepare=False`` quantizes the graph
    as it is, as sentence-transformers does (``onnx_int8.quantize_int8``). ``forms``: each low-rank pair's
    serving form and each layer's precision, timed on this machine (``"auto"``) or one form for every pair
    (``form_timing.plan_forms``); the plans are written beside the graphs."""
    with eager_attention(model):
        return _write_graphs(model, tokenizer, directory, opset, quantize, arch, prepare, forms, progress)


@contextlib.contextmanager
def eager_attention(model: nn.Module):
    """The model with transformers' plain attention while it is exported, then as it was: the exporter writes
    SDPA with a guard over the whole attention matrix (IsNaN, Where) that costs onnxruntime more than the
    int8 products around it (docs/findings.md), and the plain attention computes the same."""
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        yield model
        return
    try:
        model.set_attn_implementation("eager")
    except (ValueError, ImportError):  # an architecture without the plain one: exported as it is
        yield model
        return
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


@dataclass
class Reference:
    """The tokenized sample every exported graph is checked on, and PyTorch's output for it."""

    sample: dict
    output_name: str
    expected: torch.Tensor


def reference_outputs(model: nn.Module, tokenizer) -> Reference:
    encoded = tokenizer(SAMPLE_TEXTS, padding=True, return_tensors="pt")
    sample = {name: encoded[name] for name in INPUT_NAMES if name in encoded}
    with torch.no_grad():
        output_name, expected = MainOutput.pick(model(**sample, **MainOutput(model).use_cache))
    return Reference(sample, output_name, expected)


def _write_graphs(model, tokenizer, directory: Path, opset, quantize, arch, prepare, forms, progress) -> OnnxExport:
    reference = reference_outputs(model, tokenizer)
    torch_dtype = next(model.parameters()).dtype
    plans = {ONNX_FILE: plan_forms(model, "onnx", False, forms, progress=progress)}
    file = directory / ONNX_FILE
    _export_served(model, plans[ONNX_FILE], reference, file, opset, progress)
    progress("checking with onnxruntime")
    difference = _check_with_onnxruntime(file, reference.sample, reference.expected, torch_dtype)
    result = OnnxExport(out=directory, output_name=reference.output_name, opset=opset, max_difference=difference,
                        graphs=[file])
    if quantize:
        quantized = directory / int8_file_name(arch)
        plans[quantized.name] = plan = plan_forms(model, "onnx", True, forms, progress=progress)
        with tempfile.TemporaryDirectory(prefix="comera-onnx-") as folder:
            source = file
            if plan.forms() != plans[ONNX_FILE].forms():
                source = Path(folder) / ONNX_FILE
                _export_served(model, plan, reference, source, opset, progress)
            progress(f"quantizing to int8 for {arch}")
            quantize_int8(source, quantized, arch, prepare=prepare, float_layers=plan.float_layers())
        result.int8_difference = _check_int8(quantized, reference.sample, reference.expected)
        result.graphs.append(quantized)
    result.forms = write_plans(plans, directory)
    return result


def _export_served(model, plan, reference: "Reference", file: Path, opset: int, progress) -> None:
    """``model`` in the serving forms of ``plan`` (``layers/serving_forms.py``) exported to ``file``."""
    progress(f"exporting to ONNX (opset {opset})")
    _export(MainOutput(serving_copy(model, plan.forms())), reference.sample, file, opset, reference.output_name)
    _into_one_file(file)


def _into_one_file(file: Path) -> None:
    """Fold the exporter's external weight file into the graph where protobuf allows it: one file to ship,
    and the layout sentence-transformers' own exports have."""
    import onnx

    data = external_data(file)
    if not data or sum(p.stat().st_size for p in data) > ONE_FILE_BYTES:
        return
    graph = onnx.load(str(file))  # external data is read alongside
    onnx.save(graph, str(file))
    for extra in data:
        extra.unlink()


def _export(wrapped: nn.Module, sample: dict, file: Path, opset: int, output_name: str) -> None:
    dynamic = {name: {0: "batch", 1: "sequence"} for name in sample}
    with quiet_exporter():
        try:
            torch.onnx.export(wrapped, (), str(file), kwargs=sample, dynamo=True, opset_version=opset,
                              input_names=list(sample), output_names=[output_name], dynamic_shapes=dynamic,
                              verbose=False)
        except Exception as err:  # the exporter's errors span many types and pages: the cause's first line
            cause = err.__cause__ or err
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            raise ConfigError(f"ONNX export of {type(wrapped.model).__name__} failed: {first}") from None


def _check_with_onnxruntime(file: Path, sample: dict, expected: torch.Tensor, dtype: torch.dtype) -> float | None:
    """Run the exported graph on the sample and compare with PyTorch; a disagreement is an error."""
    try:
        import onnxruntime
    except ImportError:
        logging.getLogger(__name__).warning("onnxruntime is not installed: the export was not checked "
                                            "(pip install 'comera-convert[onnx]')")
        return None
    got = _run_graph(onnxruntime, file, sample).float()
    difference = float((got - expected.float()).abs().max())
    scale = float(expected.float().abs().max()) or 1.0
    if not difference <= TOLERANCE[dtype] * scale:
        raise ConfigError(f"the exported graph disagrees with PyTorch: largest difference {difference:.3g} "
                          f"against outputs up to {scale:.3g}; nothing was written")
    return difference


def _run_graph(onnxruntime, file: Path, sample: dict) -> torch.Tensor:
    """The graph's first output on the tokenized sample, run by onnxruntime on the CPU."""
    session = onnxruntime.InferenceSession(str(file), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {i.name: sample[i.name].numpy() for i in session.get_inputs()})[0])


def _check_int8(file: Path, sample: dict, expected: torch.Tensor) -> float:
    import onnxruntime

    return relative_error(_run_graph(onnxruntime, file, sample), expected, "the int8 graph")


def relative_error(got: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """An int8 graph's relative error against PyTorch on the sample; a graph that computes something else
    (error above ``INT8_TOLERANCE``) is an error."""
    error = float((got.float() - expected.float()).norm() / expected.float().norm())
    if not error <= INT8_TOLERANCE:
        raise ConfigError(f"{what} strays from PyTorch: relative error {error:.3g} against at most "
                          f"{INT8_TOLERANCE}; nothing was written")
    return error
