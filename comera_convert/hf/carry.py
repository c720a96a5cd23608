"""Carrying a source checkpoint's non-weight files into a compressed (or decompressed) one.

A checkpoint is more than its weights: sentence-transformers' module configs and folders
(modules.json, 1_Pooling/, sentence_bert_config.json), the generation config, the chat template,
the tokenizer, the model card. Everything that is not a weight travels as it is, so the written
checkpoint opens as the same pipeline. Never carried: weights and weight indexes (they describe
the dense model), exported runtimes of the dense model (onnx/, openvino/: they would load the
dense weights under the compressed model's name), files the save itself wrote (transformers'
config.json and generation config are those of the model being saved), comera's own bookkeeping
(written afresh), training output folders, and hidden files. Module folders travel whole, their
own weights included (sentence-transformers' Dense projections are not converted). A file that cannot be read is
skipped with a warning; it never fails the save.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.ot",
                   "*.onnx", "*.onnx_data", "*.tflite", "*.gguf", "*.mlmodel", "*.mlpackage",
                   "*.safetensors.index.json", "*.bin.index.json")
# Folders holding the dense model in another runtime's format.
DENSE_EXPORT_FOLDERS = ("onnx", "openvino", "coreml", "tflite")
# Written afresh for every checkpoint, or training's working files.
OWN_FILES = ("comera_*", "training_curve.png", "training_args.bin", "trainer_state.json")
# Training outputs: `comera train`'s checkpoints/, Trainer's checkpoint-N/, TensorBoard's runs/.
OWN_FOLDERS = ("checkpoints", "checkpoint-*", "runs")
MODEL_CARD = "README.md"  # merged into the new card (model_card.py), never copied over it


def carried(source: Path) -> list[Path]:
    """The top-level files and folders of ``source`` that travel with a converted checkpoint."""
    items = []
    for item in sorted(source.iterdir()):
        name = item.name
        if name.startswith(".") or name == MODEL_CARD or any(fnmatch.fnmatch(name, p) for p in OWN_FILES):
            continue
        if item.is_dir():
            if name in DENSE_EXPORT_FOLDERS or any(fnmatch.fnmatch(name, p) for p in OWN_FOLDERS):
                continue
        elif _is_weight(name):
            continue
        items.append(item)
    return items


def _is_weight(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in WEIGHT_PATTERNS)


def carry_files(source, directory: Path) -> list[str]:
    """Copy ``source``'s non-weight files and folders into ``directory`` (not over what the save
    wrote there); returns the names copied. A source that is not a local directory carries nothing."""
    if source is None or not Path(source).is_dir():
        return []
    copied = []
    for item in carried(Path(source)):
        target = directory / item.name
        if target.exists():
            continue  # the model being saved wrote its own (config.json, generation_config.json, ...)
        try:
            if item.is_dir():
                shutil.copytree(item, target, ignore=_skip_inside, ignore_dangling_symlinks=True)
            else:
                shutil.copy2(item, target)
        except (OSError, shutil.Error) as err:
            logger.warning("did not carry %s from %s: %s", item.name, source, _reason(err))
            _remove(target)
            continue
        copied.append(item.name)
    return copied


def _skip_inside(folder: str, names: list[str]) -> list[str]:
    """Inside carried folders only hidden files stay behind: a module folder's weights (a
    sentence-transformers Dense projection in 2_Dense/) belong to modules comera never converts."""
    return [n for n in names if n.startswith(".")]


def _reason(err: Exception) -> str:
    if isinstance(err, shutil.Error):  # copytree gathers (source, target, why) per failed file
        first = err.args[0][0] if err.args and err.args[0] else None
        return f"{first[2]}" if first else str(err)
    return err.strerror or str(err)


def _remove(target: Path) -> None:
    if target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    elif target.exists():
        target.unlink()
