"""`comera export`: a compressed checkpoint's graphs for a serving runtime, where sentence-transformers
looks for them.

``fmt="onnx"`` writes ``onnx/`` (``onnx_export.py``, and ``onnx_int8.py`` for int8), ``fmt="openvino"``
``openvino/`` (``openvino_export.py``). Without ``out`` the folder is written into the checkpoint
itself; with ``out``, ``out`` becomes a copy of the checkpoint without its PyTorch weights: the
architecture's config.json, the tokenizer, and a sentence-transformers model's modules (modules.json,
pooling and the other module folders), so that ``SentenceTransformer(out, backend=...)`` loads it where
comera_convert is not installed. Every graph is checked against PyTorch before anything is moved into
place.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..layers import TTModule
from ..models import load_tokenizer, resolve
from ..progress import Progress, no_progress
from .config import COMPRESSION_KEYS
from .loading import from_pretrained
from .onnx_export import DEFAULT_OPSET, DTYPES, INT8_NOTE, MIN_OPSET, ONNX_FOLDER, QUANTIZE, OnnxExport, write_graphs
from .onnx_int8 import check_arch, require_onnxruntime, this_machine_arch
from .openvino_export import OPENVINO_FOLDER, require_openvino, write_openvino_graphs
from .saving import atomic_directory, check_output_dir
from .sentence_config import read_modules

FORMATS = {"onnx": ONNX_FOLDER, "openvino": OPENVINO_FOLDER}  # each runtime's graphs, and the folder they go in
# A sentence-transformers model's files beside its module folders (the tokenizer is saved anew).
SENTENCE_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def check_request(opset: int, dtype: str, quantize: str | None = None, fmt: str = "onnx",
                  arch: str | None = None) -> torch.dtype:
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: graphs are written for {' or '.join(FORMATS)}")
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
    if fmt == "openvino" and dtype != "float32":
        raise ConfigError(f"--format openvino with --dtype {dtype}: OpenVINO graphs are written in float32, and "
                          "OpenVINO picks its own compute precision (drop --dtype)")
    if fmt == "openvino" and arch is not None:
        raise ConfigError(f"--arch {arch} names an ONNX int8 file; OpenVINO's int8 graph serves every CPU "
                          "(drop --arch)")
    return DTYPES[dtype]


def export_model(model_name: str, out=None, *, opset: int = DEFAULT_OPSET, dtype: str = "float32",
                quantize: str | None = None, arch: str | None = None, overwrite: bool = False,
                fmt: str = "onnx", forms: str = "auto", progress: Progress = no_progress) -> OnnxExport:
    """Export the checkpoint ``model_name`` to ``onnx/`` (``fmt="openvino"``: ``openvino/``) in ``out`` (a copy
    of the checkpoint without its weights), else in the checkpoint itself, atomically; ``quantize="int8"``
    adds the int8 graph (ONNX: for ``arch``, this machine's where None). ``forms``: each low-rank pair's form
    and each layer's precision, timed on this machine (``"auto"``) or one form for every pair
    (``form_timing.plan_forms``)."""
    torch_dtype = check_request(opset, dtype, quantize, fmt, arch)
    arch = _require_runtime(fmt, quantize, arch)
    path = Path(resolve(model_name))
    folder, target = _destination(path, out, overwrite, FORMATS[fmt])
    progress(f"loading {model_name}")
    model = from_pretrained(str(path)).to(torch_dtype).eval()
    tokenizer = load_tokenizer(str(path), "ONNX export")
    with atomic_directory(target, replace_dir=True) as tmp:
        graphs_dir = tmp / FORMATS[fmt] if out is not None else tmp
        graphs_dir.mkdir(exist_ok=True)
        result = _write_format(fmt, model, tokenizer, graphs_dir, opset, quantize, arch, forms, progress)
        if out is not None:
            _write_config(model.config, tmp)
            tokenizer.save_pretrained(tmp)
            _portable_tokenizer_class(tmp)
            _copy_sentence_modules(path, tmp)
    result.out = folder
    result.graphs = [folder / FORMATS[fmt] / file.name for file in result.graphs]
    result.notes = _layout_notes(model) + _sentence_notes(path) + _int8_notes(result)
    return result


def _require_runtime(fmt: str, quantize: str | None, arch: str | None) -> str | None:
    """Refuse a request whose runtime is not installed; the ONNX int8 graph's architecture."""
    if fmt == "openvino":
        require_openvino("--format openvino")
        return None
    if quantize:
        require_onnxruntime(f"--quantize {quantize}")
    return check_arch(arch) if arch is not None else this_machine_arch() if quantize else None


def _write_format(fmt, model, tokenizer, directory: Path, opset, quantize, arch, forms, progress) -> OnnxExport:
    if fmt == "openvino":
        return write_openvino_graphs(model, tokenizer, directory, quantize=quantize, forms=forms, progress=progress)
    return write_graphs(model, tokenizer, directory, opset=opset, quantize=quantize, arch=arch, forms=forms,
                        progress=progress)


def _destination(path: Path, out, overwrite: bool, graphs: str = ONNX_FOLDER) -> tuple[Path, Path]:
    """(the folder that will hold the ``graphs`` folder, the folder written atomically): ``out`` whole, or
    the checkpoint's ``graphs`` folder alone."""
    if out is not None:
        out = check_output_dir(out, overwrite)
        return out, out
    if not path.is_dir():
        raise ConfigError(f"{path} is not a local checkpoint folder to write {graphs}/ into: give --out")
    if (path / graphs).exists() and not overwrite:
        raise ConfigError(f"{path / graphs} exists: pass --overwrite to replace it, or give --out")
    return path, path / graphs


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

    for name in SENTENCE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, directory / name)
    for module in read_modules(source) or []:
        folder = module.get("path") or ""
        if folder and (source / folder).is_dir():
            shutil.copytree(source / folder, directory / folder)


def _int8_notes(result: OnnxExport) -> list[str]:
    if result.int8_difference is None or result.int8_difference <= INT8_NOTE:
        return []
    return [f"int8 rounding moved the hidden states by {result.int8_difference:.0%} of their norm on the sample: "
            "measure the retrieval it keeps before serving it (comera bench serving --checkpoint)"]


def _sentence_notes(source: Path) -> list[str]:
    if read_modules(source) is not None:
        return []
    return ["not a sentence-transformers model (no modules.json): the graphs give token states, and pooling "
            "is not in them"]


def _layout_notes(model: nn.Module) -> list[str]:
    """ttm layers export correctly but run slowly in onnxruntime (docs/findings.md)."""
    ttm = [name for name, module in model.named_modules() if isinstance(module, TTModule) and module.layout == "ttm"]
    if not ttm:
        return []
    return [f"{len(ttm)} ttm layers (such as {ttm[0]}): onnxruntime runs ttm contractions many times slower "
            "than tt; convert with --layout tt --embedding-layout tt to serve"]


def _write_config(config, directory: Path) -> None:
    """The architecture's config.json without comera's records: the graph holds the weights, and
    a loader that saw ``quantization_config`` would look for comera's modules."""
    import json

    data = {k: v for k, v in config.to_dict().items() if k not in COMPRESSION_KEYS}
    (directory / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
