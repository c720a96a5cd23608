"""Facts about a checkpoint on disk, read without loading the model: what `comera report` shows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .conversion.report import ConversionReport, read_report
from .errors import ModelLoadError
from .hf.checkpoint_check import read_header
from .hf.config import compression_of
from .hf.integer_storage import SCALE_SUFFIX
from .hf.model_card import source_card
from .models import not_found_error, read_config, resolve


@dataclass
class CheckpointInfo:
    name: str
    path: str
    model_type: str
    params: int
    disk_bytes: int
    compressed: bool
    report: ConversionReport | None
    licence: str | None = None  # from the model card's metadata (the source's, for a compressed model)

    def to_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "model_type": self.model_type, "params": self.params,
                "disk_bytes": self.disk_bytes, "compressed": self.compressed, "licence": self.licence,
                "report": self.report.to_dict() if self.report else None}


def _weight_files(path: str) -> list[Path]:
    local = Path(path)
    if local.is_dir():
        files = sorted(local.glob("*.safetensors"))
        if files:
            return files
        raise ModelLoadError(f"{path} has no .safetensors weights (comera reads safetensors only, never pickle)")
    try:
        from huggingface_hub import hf_hub_download

        return [Path(hf_hub_download(path, "model.safetensors"))]
    except Exception as err:
        raise not_found_error(path, err) from None


FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def _stored_params(headers: list[dict]) -> int:
    """The parameters the files hold; a codebook table's one-byte codes count as the parameters they
    weigh as much as (``CodebookSpec.stored_params``), as the conversion report counts them. A factor
    stored as integers (values with a ``<name>_scale`` beside them) counts its values, two a byte
    for int4; its scales are storage, not parameters (``comera report`` shows the bytes)."""
    tensors = {k: v for header in headers for k, v in header.items() if k != "__metadata__"}
    scaled = {k.removesuffix(SCALE_SUFFIX) for k in tensors if k.endswith(SCALE_SUFFIX)}
    element_size = next((FLOAT_BYTES[v["dtype"]] for k, v in tensors.items()
                         if v["dtype"] in FLOAT_BYTES and k.removesuffix(SCALE_SUFFIX) not in scaled), 1)

    def params(name: str, entry: dict) -> int:
        count = math.prod(entry["shape"])
        if name in scaled:
            return 2 * count if entry["dtype"] == "U8" else count  # int4 packs two values a byte
        return math.ceil(count / element_size) if entry["dtype"] == "U8" else count

    return sum(params(k, v) for k, v in tensors.items() if k.removesuffix(SCALE_SUFFIX) not in scaled or k in scaled)


def inspect_checkpoint(name: str) -> CheckpointInfo:
    path = resolve(name)
    config = read_config(path)
    files = _weight_files(path)
    params = _stored_params([read_header(str(file)) for file in files])
    compressed = compression_of(config) is not None
    report = read_report(path) if compressed else None
    card = source_card(path) if Path(path).is_dir() else None
    return CheckpointInfo(name=name, path=path, model_type=config.get("model_type", "?"), params=params,
                          disk_bytes=sum(f.stat().st_size for f in files), compressed=compressed, report=report,
                          licence=card.licence if card else None)
