"""ONNX export of a compressed checkpoint: the model leaves Python, still compressed.

torch's exporter (``torch.onnx.export(dynamo=True)``) traces the TT contractions as they are, so
the graph holds the cores (or the two merged halves the optimizer folds them into), not dense
weights. The output is a folder as optimum writes one: ``model.onnx`` (and ``model.onnx.data``
when the weights go to an external file), ``config.json`` and the tokenizer. The export is checked
against PyTorch with onnxruntime on a tokenized sample before it is moved into place.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..progress import Progress, no_progress

ONNX_FILE = "model.onnx"
# torch's exporter implements opset 18 and later; an earlier one goes through a version converter
# that, where it fails, silently keeps 18: refused instead.
MIN_OPSET = 18
DEFAULT_OPSET = 18
DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Largest |ONNX - PyTorch| accepted, relative to the largest |PyTorch| output, by dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")  # the graph's inputs, where the tokenizer gives them
SAMPLE_TEXTS = ["Tensor trains keep large models small.", "A second, longer sample sentence to pad the batch with."]


@dataclass
class OnnxExport:
    out: Path
    output_name: str
    opset: int
    max_difference: float | None  # None: onnxruntime was not there to check
    notes: list[str] = field(default_factory=list)


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


def check_request(opset: int, dtype: str) -> torch.dtype:
    if opset < MIN_OPSET:
        raise ConfigError(f"--opset {opset}: torch's ONNX exporter writes opset {MIN_OPSET} or later "
                          f"(an earlier one may silently stay at {MIN_OPSET}); use --opset {MIN_OPSET} or more")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: ONNX export takes {' or '.join(DTYPES)} (onnxruntime has no "
                          f"bfloat16 kernels for most operators)")
    return DTYPES[dtype]


def export_onnx(model_name: str, out, *, opset: int = DEFAULT_OPSET, dtype: str = "float32",
                overwrite: bool = False, progress: Progress = no_progress) -> OnnxExport:
    """Export the compressed checkpoint ``model_name`` to the folder ``out`` (atomically)."""
    from ..models import load_tokenizer, resolve
    from .loading import from_pretrained
    from .saving import atomic_directory, check_output_dir

    torch_dtype = check_request(opset, dtype)
    out = check_output_dir(out, overwrite)
    path = resolve(model_name)
    progress(f"loading {model_name}")
    model = from_pretrained(path).to(torch_dtype).eval()
    tokenizer = load_tokenizer(path, "ONNX export")
    encoded = tokenizer(SAMPLE_TEXTS, padding=True, return_tensors="pt")
    sample = {name: encoded[name] for name in INPUT_NAMES if name in encoded}
    wrapped = MainOutput(model)
    with torch.no_grad():
        output_name, expected = MainOutput.pick(model(**sample, **wrapped.use_cache))
    with atomic_directory(out, replace_dir=True) as tmp:
        progress(f"exporting to ONNX (opset {opset})")
        _export(wrapped, sample, tmp / ONNX_FILE, opset, output_name)
        progress("checking with onnxruntime")
        difference = _check_with_onnxruntime(tmp / ONNX_FILE, sample, expected, torch_dtype)
        _write_config(model.config, tmp)
        tokenizer.save_pretrained(tmp)
    return OnnxExport(out=out, output_name=output_name, opset=opset, max_difference=difference,
                      notes=_layout_notes(model))


def _layout_notes(model: nn.Module) -> list[str]:
    """ttm layers export correctly but run slowly in onnxruntime (docs/findings.md)."""
    from ..layers import TTModule

    ttm = [name for name, module in model.named_modules() if isinstance(module, TTModule) and module.layout == "ttm"]
    if not ttm:
        return []
    return [f"{len(ttm)} ttm layers (such as {ttm[0]}): onnxruntime runs ttm contractions slowly (MiniLM: "
            f"13x the time of the same model in tt); convert with --layout tt --embedding-layout tt to serve"]


def _write_config(config, directory: Path) -> None:
    """The architecture's config.json without comera's records: the graph holds the weights, and
    a loader that saw ``quantization_config`` would look for comera's modules."""
    import json

    from .config import COMPRESSION_KEYS

    data = {k: v for k, v in config.to_dict().items() if k not in COMPRESSION_KEYS}
    (directory / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _export(wrapped: nn.Module, sample: dict, file: Path, opset: int, output_name: str) -> None:
    dynamic = {name: {0: "batch", 1: "sequence"} for name in sample}
    with _quiet_exporter():
        try:
            torch.onnx.export(wrapped, (), str(file), kwargs=sample, dynamo=True, opset_version=opset,
                              input_names=list(sample), output_names=[output_name], dynamic_shapes=dynamic,
                              verbose=False)
        except Exception as err:  # the exporter's errors span many types and pages: the cause's first line
            cause = err.__cause__ or err
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            raise ConfigError(f"ONNX export of {type(wrapped.model).__name__} failed: {first}") from None


@contextlib.contextmanager
def _quiet_exporter():
    """The exporter prints its progress and warns about optional packages; none of it is the user's."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _check_with_onnxruntime(file: Path, sample: dict, expected: torch.Tensor, dtype: torch.dtype) -> float | None:
    """Run the exported graph on the sample and compare with PyTorch; a disagreement is an error."""
    try:
        import onnxruntime
    except ImportError:
        logging.getLogger(__name__).warning("onnxruntime is not installed: the export was not checked "
                                            "(pip install 'comera-convert[onnx]')")
        return None
    session = onnxruntime.InferenceSession(str(file), providers=["CPUExecutionProvider"])
    feeds = {i.name: sample[i.name].numpy() for i in session.get_inputs()}
    got = torch.from_numpy(session.run(None, feeds)[0]).float()
    difference = float((got - expected.float()).abs().max())
    scale = float(expected.float().abs().max()) or 1.0
    if not difference <= TOLERANCE[dtype] * scale:
        raise ConfigError(f"the exported graph disagrees with PyTorch: largest difference {difference:.3g} "
                          f"against outputs up to {scale:.3g}; nothing was written")
    return difference
