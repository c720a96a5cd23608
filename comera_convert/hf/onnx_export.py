"""ONNX export of a compressed checkpoint: the model leaves Python, still compressed.

torch's exporter (``torch.onnx.export(dynamo=True)``) traces the TT contractions as they are, so
the graph holds the cores (or the two merged halves the optimizer folds them into), not dense
weights. The graphs go where sentence-transformers and optimum look for them, an ``onnx/`` folder:
``onnx/model.onnx`` (one file, its weights inside, below protobuf's 2 GB), and with ``quantize="int8"``
``onnx/model_qint8_<arch>.onnx`` quantized as sentence-transformers quantizes a dense model's export
(``onnx_int8.py``). Without ``out`` the folder is written into the checkpoint itself; with ``out``,
``out`` becomes a copy of the checkpoint without its PyTorch weights: the architecture's config.json,
the tokenizer, and a sentence-transformers model's modules (modules.json, pooling and the other
module folders), so that ``SentenceTransformer(out, backend="onnx")`` loads it where comera_convert
is not installed. Each graph is checked against PyTorch with onnxruntime on a tokenized sample
before anything is moved into place.
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
# Largest ||ONNX - PyTorch|| / ||PyTorch|| of the int8 graph's hidden states: int8 rounding moves
# MiniLM's by a few percent; a wrong graph moves them by the order of the states themselves.
INT8_TOLERANCE = 0.2
ONE_FILE_BYTES = 2 ** 31 - 2 ** 26  # protobuf's 2 GB limit on one file, less room for the graph itself
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")  # the graph's inputs, where the tokenizer gives them
SAMPLE_TEXTS = ["Tensor trains keep large models small.", "A second, longer sample sentence to pad the batch with."]
# A sentence-transformers model's files beside its module folders (the tokenizer is saved anew).
SENTENCE_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


@dataclass
class OnnxExport:
    out: Path  # the folder holding onnx/
    output_name: str
    opset: int
    max_difference: float | None  # None: onnxruntime was not there to check
    graphs: list[Path] = field(default_factory=list)  # the written graphs, float first
    int8_difference: float | None = None  # relative error of the int8 graph's hidden states
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


def check_request(opset: int, dtype: str, quantize: str | None = None) -> torch.dtype:
    if opset < MIN_OPSET:
        raise ConfigError(f"--opset {opset}: torch's ONNX exporter writes opset {MIN_OPSET} or later "
                          f"(an earlier one may silently stay at {MIN_OPSET}); use --opset {MIN_OPSET} or more")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: ONNX export takes {' or '.join(DTYPES)} (onnxruntime has no "
                          f"bfloat16 kernels for most operators)")
    if quantize is not None and quantize not in QUANTIZE:
        raise ConfigError(f"--quantize {quantize}: ONNX export quantizes to {' or '.join(QUANTIZE)}")
    if quantize is not None and dtype != "float32":
        raise ConfigError(f"--quantize {quantize} with --dtype {dtype}: int8 quantization starts from the "
                          "float32 graph (drop --dtype)")
    return DTYPES[dtype]


def export_onnx(model_name: str, out=None, *, opset: int = DEFAULT_OPSET, dtype: str = "float32",
                quantize: str | None = None, arch: str | None = None, overwrite: bool = False,
                progress: Progress = no_progress) -> OnnxExport:
    """Export the checkpoint ``model_name`` to ``onnx/`` in ``out`` (a copy of the checkpoint without
    its weights), else in the checkpoint itself, atomically; ``quantize="int8"`` adds the int8 graph
    for ``arch`` (this machine's where None)."""
    from ..models import load_tokenizer, resolve
    from .loading import from_pretrained
    from .onnx_int8 import check_arch, require_onnxruntime, this_machine_arch
    from .saving import atomic_directory

    torch_dtype = check_request(opset, dtype, quantize)
    arch = check_arch(arch) if arch is not None else this_machine_arch() if quantize else None
    if quantize:
        require_onnxruntime(f"--quantize {quantize}")
    path = Path(resolve(model_name))
    folder, target = _destination(path, out, overwrite)
    progress(f"loading {model_name}")
    model = from_pretrained(str(path)).to(torch_dtype).eval()
    tokenizer = load_tokenizer(str(path), "ONNX export")
    with atomic_directory(target, replace_dir=True) as tmp:
        graphs_dir = tmp / ONNX_FOLDER if out is not None else tmp
        graphs_dir.mkdir(exist_ok=True)
        result = write_graphs(model, tokenizer, graphs_dir, opset=opset, quantize=quantize, arch=arch,
                              progress=progress)
        if out is not None:
            _write_config(model.config, tmp)
            tokenizer.save_pretrained(tmp)
            _portable_tokenizer_class(tmp)
            _copy_sentence_modules(path, tmp)
    result.out = folder
    result.graphs = [folder / ONNX_FOLDER / file.name for file in result.graphs]
    result.notes = _layout_notes(model) + _sentence_notes(path)
    return result


def _destination(path: Path, out, overwrite: bool) -> tuple[Path, Path]:
    """(the folder that will hold onnx/, the folder written atomically): ``out`` whole, or the
    checkpoint's onnx/ alone."""
    from .saving import check_output_dir

    if out is not None:
        out = check_output_dir(out, overwrite)
        return out, out
    if not path.is_dir():
        raise ConfigError(f"{path} is not a local checkpoint folder to write onnx/ into: give --out")
    if (path / ONNX_FOLDER).exists() and not overwrite:
        raise ConfigError(f"{path / ONNX_FOLDER} exists: pass --overwrite to replace it, or give --out")
    return path, path / ONNX_FOLDER


def write_graphs(model: nn.Module, tokenizer, directory: Path, *, opset: int = DEFAULT_OPSET,
                 quantize: str | None = None, arch: str | None = None, prepare: bool = True,
                 progress: Progress = no_progress) -> OnnxExport:
    """Write ``model``'s graph (in its dtype) to ``directory/model.onnx`` and, with ``quantize``, the int8 graph
    for ``arch``, each checked against PyTorch on a tokenized sample; ``prepare=False`` quantizes the graph
    as it is, as sentence-transformers does (``onnx_int8.quantize_int8``)."""
    with eager_attention(model):
        return _write_graphs(model, tokenizer, directory, opset, quantize, arch, prepare, progress)


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


def _write_graphs(model, tokenizer, directory: Path, opset, quantize, arch, prepare, progress) -> OnnxExport:
    from .onnx_int8 import int8_file_name, quantize_int8

    encoded = tokenizer(SAMPLE_TEXTS, padding=True, return_tensors="pt")
    sample = {name: encoded[name] for name in INPUT_NAMES if name in encoded}
    wrapped = MainOutput(model)
    with torch.no_grad():
        output_name, expected = MainOutput.pick(model(**sample, **wrapped.use_cache))
    torch_dtype = next(model.parameters()).dtype
    file = directory / ONNX_FILE
    progress(f"exporting to ONNX (opset {opset})")
    _export(wrapped, sample, file, opset, output_name)
    _into_one_file(file)
    progress("checking with onnxruntime")
    result = OnnxExport(out=directory, output_name=output_name, opset=opset,
                        max_difference=_check_with_onnxruntime(file, sample, expected, torch_dtype), graphs=[file])
    if quantize:
        progress(f"quantizing to int8 for {arch}")
        quantized = directory / int8_file_name(arch)
        quantize_int8(file, quantized, arch, prepare=prepare)
        result.int8_difference = _check_int8(quantized, sample, expected)
        result.graphs.append(quantized)
    return result


def _into_one_file(file: Path) -> None:
    """Fold the exporter's external weight file into the graph where protobuf allows it: one file to ship,
    and the layout sentence-transformers' own exports have."""
    import onnx

    from .onnx_int8 import external_data

    data = external_data(file)
    if not data or sum(p.stat().st_size for p in data) > ONE_FILE_BYTES:
        return
    graph = onnx.load(str(file))  # external data is read alongside
    onnx.save(graph, str(file))
    for extra in data:
        extra.unlink()


# transformers 5 saves a tokenizer built from a tokenizer.json alone under a class name transformers 4
# does not know; the name both load it by, for a serving environment on either.
PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def _portable_tokenizer_class(directory: Path) -> None:
    import json

    file = directory / "tokenizer_config.json"
    if not file.is_file():
        return
    config = json.loads(file.read_text())
    if config.get("tokenizer_class") in PORTABLE_TOKENIZER_CLASSES:
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASSES[config["tokenizer_class"]]
        file.write_text(json.dumps(config, indent=2) + "\n")


def _copy_sentence_modules(source: Path, directory: Path) -> None:
    """A sentence-transformers model's module list and module folders (pooling, dense, normalize),
    so that the copy embeds as the checkpoint does."""
    import shutil

    from .sentence_config import read_modules

    for name in SENTENCE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, directory / name)
    for module in read_modules(source) or []:
        folder = module.get("path") or ""
        if folder and (source / folder).is_dir():
            shutil.copytree(source / folder, directory / folder)


def _sentence_notes(source: Path) -> list[str]:
    from .sentence_config import read_modules

    if read_modules(source) is not None:
        return []
    return ["not a sentence-transformers model (no modules.json): the graphs give token states, and pooling "
            "is not in them"]


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
    """The int8 graph's relative error against PyTorch on the sample; a graph that computes something
    else is an error."""
    import onnxruntime

    got = _run_graph(onnxruntime, file, sample)
    error = float((got.float() - expected.float()).norm() / expected.float().norm())
    if not error <= INT8_TOLERANCE:
        raise ConfigError(f"the int8 graph strays from PyTorch: relative error {error:.3g} against at most "
                          f"{INT8_TOLERANCE}; nothing was written")
    return error
