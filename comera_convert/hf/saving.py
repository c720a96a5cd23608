"""Writing compressed checkpoints: atomically, loadable three ways, never silently wrong.

``save_compressed`` runs transformers' own ``save_pretrained`` into a temporary sibling
directory, then adds what makes the directory a comera checkpoint and moves it into place:
  * config.json: ``quantization_config`` (the module records; transformers writes it),
    ``transformers_weights`` set to a guard file name (a transformers without comera_convert
    stops on it with the instruction to install and import comera_convert), and ``auto_map``
    entries that load the model with ``trust_remote_code=True``;
  * comera_remote.py: the file those entries name (it imports comera_convert);
  * comera_report.json and a README.md model card (model_card.py) on top of the source's card;
  * every non-weight file and folder of the source directory (carry.py): tokenizer,
    sentence-transformers modules, generation config, chat template.
Converted models get ``save_pretrained`` routed here (``compat.install_save_hook``), so
``model.save_pretrained(dir)`` and Trainer checkpoints are compressed checkpoints too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..conversion.report import REPORT_FILE, describe
from ..errors import ConfigError, expected
from .carry import carry_files
from .config import WEIGHTS_GUARD, integer_format_of
from .integer_storage import write_integer_checkpoint
from .model_card import source_card, write_model_card

REMOTE_MODULE = "comera_remote"
# Auto classes a checkpoint can be opened with, by the transformers mapping that lists them.
AUTO_CLASSES = {
    "AutoModel": "MODEL_MAPPING_NAMES",
    "AutoModelForMaskedLM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForTokenClassification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForQuestionAnswering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "AutoModelForPreTraining": "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
}


def auto_map_for(model_type: str) -> dict[str, str]:
    """{Auto class: "comera_remote.<Class>"} for every Auto class that knows this model type."""
    from transformers.models.auto import modeling_auto

    entries = {}
    for auto_name, mapping_name in AUTO_CLASSES.items():
        class_name = getattr(modeling_auto, mapping_name, {}).get(model_type)
        if isinstance(class_name, str):
            entries[auto_name] = f"{REMOTE_MODULE}.{class_name}"
    return entries


def remote_code(auto_map: dict[str, str]) -> str:
    classes = sorted({ref.split(".", 1)[1] for ref in auto_map.values()})
    return (
        '"""Opens this comera_convert tensor-train checkpoint with `trust_remote_code=True`.\n\n'
        "Importing comera_convert registers the loading method that builds the TT modules; the\n"
        'classes are transformers\' own. Needs: pip install comera-convert\n"""\n\n'
        "import comera_convert  # noqa: F401\n"
        f"from transformers import {', '.join(classes)}  # noqa: F401\n"
    )


def _patch_config(directory: Path) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["transformers_weights"] = WEIGHTS_GUARD
    auto_map = auto_map_for(config.get("model_type", ""))
    if auto_map:
        config["auto_map"] = {**config.get("auto_map", {}), **auto_map}
        (directory / f"{REMOTE_MODULE}.py").write_text(remote_code(auto_map))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


SIZE_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
              "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def shard_bytes(size: int | str) -> int:
    """A shard size (``2GB``, ``500MiB``, ``1000000``) in bytes, refused in one line if it is none."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(size))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in SIZE_UNITS or int(match.group(1)) == 0:
        raise ConfigError(expected("--max-shard-size as a positive size such as 2GB, 500MB or 10GiB", size))
    return int(match.group(1)) * SIZE_UNITS[unit]


def shard_kwargs(max_shard_size: int | str | None) -> dict:
    """``save_pretrained``'s sharding argument: transformers' own default (50GB) where none is given."""
    return {} if max_shard_size is None else {"max_shard_size": shard_bytes(max_shard_size)}


def weight_bytes(path) -> int:
    """Bytes of a checkpoint directory's weight files (safetensors, or PyTorch .bin)."""
    files = list(Path(path).glob("*.safetensors")) or list(Path(path).glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def check_output_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an output path that is a file, or a non-empty directory unless overwriting."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"the output path {out} is a file, expected a directory (or a new name)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"the output directory {out} is not empty: choose another or pass --overwrite")
    return out


# Room left besides the estimate: the model card, config and report, and the estimate's own error
# (a ratio is a target the allocation meets within a few percent).
DISK_MARGIN = 1.1
DISK_SLACK_BYTES = 64 * 2 ** 20


def check_disk_space(out: Path, needed: int, what: str) -> None:
    """Refuse, before anything is written, an output whose file system has less room than
    ``needed`` bytes (plus a margin); ``what`` says where the estimate comes from."""
    folder = Path(out).absolute()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    wanted = int(needed * DISK_MARGIN) + DISK_SLACK_BYTES
    if free < wanted:
        raise ConfigError(f"not enough disk space for {out}: {_gb(free)} free on {folder}, about {_gb(wanted)} "
                          f"needed ({what})")


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB"


def _move_into_place(tmp: Path, out: Path, replace_dir: bool) -> None:
    """A new directory is renamed in one step. An existing one is swapped whole (``replace_dir``:
    renamed aside, then removed) or gets each file replaced atomically (save_pretrained's merge)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if replace_dir:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
        return
    for item in tmp.iterdir():
        target = out / item.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)  # a folder (a sentence model's 1_Pooling) is replaced whole: rename needs it gone
        elif item.is_dir() and target.exists():
            target.unlink()
        os.replace(item, target)
    tmp.rmdir()


def open_weight_files(directory: Path) -> None:
    """Give the weight files the permissions a new file gets (safetensors writes them private, 0600)."""
    for file in directory.glob("*.safetensors"):
        file.chmod(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_directory(out: Path, replace_dir: bool):
    """Yield a temporary sibling of ``out`` to write into; on success it is moved into place
    (``_move_into_place``), on failure removed: an interrupted write leaves nothing half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would make the finished folder private
    try:
        yield tmp
        _move_into_place(tmp, out, replace_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_compressed(model, out: str | os.PathLike, *, report=None, source=None,
                    overwrite: bool = True, replace_dir: bool = False, write_weights=None, integers: bool = True,
                    **save_kwargs) -> Path:
    """Write ``model`` (converted) as a compressed checkpoint directory; returns its path.

    ``report`` defaults to a fresh description of the model as it is now (ranks after training).
    ``source``: the directory the model came from; its non-weight files travel (carry.py) and its
    model card goes below the new one. Without it (``model.save_pretrained``, Trainer checkpoints)
    only the card of the directory the model was loaded from is kept, below the new one.
    ``write_weights(directory)``, when given, writes config and weights instead of ``save_pretrained``
    (a streamed conversion's spool: ``spool.py``). A model whose config records integer storage is
    written with its factors rounded to it (``integer_storage.py``), unless ``integers`` is False
    (training checkpoints keep the floats they resume from).
    """
    out = check_output_dir(out, overwrite)
    fmt = integer_format_of(model) if integers else None
    if write_weights is None and fmt is not None:
        def write_weights(directory):  # save_pretrained's other options do not apply to these files
            write_integer_checkpoint(model, directory, fmt, save_kwargs.get("max_shard_size", "50GB"))
    with atomic_directory(out, replace_dir) as tmp:
        if write_weights is None:
            type(model).save_pretrained(model, tmp, **save_kwargs)
        else:
            write_weights(tmp)
        open_weight_files(tmp)
        _patch_config(tmp)
        carry_files(source, tmp)
        report = report if report is not None else describe(model)
        (tmp / REPORT_FILE).write_text(report.to_json() + "\n")
        card = source_card(source if source is not None else _loaded_from(model))
        write_model_card(tmp, report, card, disk_bytes=weight_bytes(tmp))
    return out


def _loaded_from(model) -> Path | None:
    """The local directory ``from_pretrained`` read this model from, if any."""
    path = getattr(model, "name_or_path", None)
    return Path(path) if path and Path(path).is_dir() else None
