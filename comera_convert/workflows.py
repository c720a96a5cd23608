"""End-to-end jobs on checkpoints, as the CLI runs them: load, convert or decompress, save."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .conversion import ConversionReport, ConvertOptions, convert_with
from .hf.saving import check_output_dir, copy_tokenizer, save_compressed
from .models import load_model


@dataclass
class ConversionResult:
    out: Path
    report: ConversionReport
    timings: dict[str, float]
    disk_bytes: int


def convert_checkpoint(model_name: str, options: ConvertOptions, out, *, task=None, overwrite=False,
                       progress=None) -> ConversionResult:
    """Load ``model_name``, convert it with ``options`` and write a compressed checkpoint to ``out``."""
    out = check_output_dir(out, overwrite)  # fail before the slow part
    start = time.perf_counter()
    model, path = load_model(model_name, task=task)
    loaded = time.perf_counter()
    calibration = _calibration(model, path, options) if options.calibration else None
    calibrated = time.perf_counter()
    report = convert_with(model, options, source=model_name, progress=progress, calibration=calibration)
    converted = time.perf_counter()
    save_compressed(model, out, report=report, tokenizer_source=path, overwrite=overwrite, replace_dir=True)
    saved = time.perf_counter()
    timings = {"load": loaded - start, "convert": converted - calibrated, "save": saved - converted}
    if calibration is not None:
        timings["calibrate"] = calibrated - loaded
    report.extra["timings"] = timings
    disk = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return ConversionResult(out=out, report=report, timings=timings, disk_bytes=disk)


def _calibration(model, path, options: ConvertOptions):
    from .conversion.calibration import calibrate
    from .models import load_tokenizer

    tokenizer = load_tokenizer(path, "--calibration")
    return calibrate(model, tokenizer, options.calibration, options.calibration_sequences,
                     options.calibration_seq_len, options.targets, options.exclude, options.d)


def decompress_checkpoint(model_name: str, out, *, overwrite=False) -> Path:
    """Write an ordinary dense checkpoint of a compressed one (atomically)."""
    from .hf.loading import decompress, from_pretrained
    from .hf.saving import atomic_directory
    from .models import resolve

    out = check_output_dir(out, overwrite)
    model = decompress(from_pretrained(model_name))
    with atomic_directory(out, replace_dir=True) as tmp:
        model.save_pretrained(tmp)
        copy_tokenizer(resolve(model_name), tmp)
    return out
