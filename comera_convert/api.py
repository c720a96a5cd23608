"""The public verbs: one per job, the same ones the CLI runs.

    convert(model, options, tokenizer=)       a model in memory, calibrated, in place -> ConversionReport
    convert_checkpoint(source, out, options)  load, calibrate, convert, save (`comera convert`) -> ConversionResult
    calibrate(model, tokenizer, data)         the statistics a data-aware conversion uses
    train(checkpoint, options, out)           rank-adaptive continued pre-training (`comera train`)
    evaluate(checkpoint, reference)           fidelity per domain (`comera eval`)
    from_pretrained(checkpoint)               load as the class it was saved from
    decompress(checkpoint, out)               a dense checkpoint (`comera decompress`)
    decompress_model(model)                   a model in memory, in place
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torch import nn

from .conversion import Calibration, ConversionReport, ConvertRequest, calibrate, plan
from .conversion.calibration import DEFAULT_CALIBRATION, calibrate_as_planned
from .conversion.hooks import IN_MEMORY, ModuleHooks
from .hf.carry import carry_files
from .hf.loading import decompress_model, from_pretrained
from .hf.model_card import source_card, write_dense_card
from .hf.saving import atomic_directory, check_output_dir, shard_kwargs
from .errors import ConfigError
from .models import load_tokenizer, resolve
from .pipeline.run import ConversionResult, convert_model
from .pipeline.run import convert_checkpoint as run_pipeline
from .progress import Progress, no_progress

__all__ = ["ConversionResult", "calibrate", "convert", "convert_checkpoint", "decompress", "decompress_model",
           "from_pretrained"]
# train and evaluate are comera_convert.training.train and comera_convert.evaluation.evaluate,
# exported from the package as they are (importing them loads transformers' Trainer).


def convert(model: nn.Module, options: ConvertRequest | None = None, *, tokenizer=None,
            calibration: Calibration | str | None = None, uncalibrated: bool = False, source: str | None = None,
            progress=None, load=None, release=None, **overrides) -> ConversionReport:
    """Convert ``model`` in place and return the report; ``model.save_pretrained`` then writes a
    compressed checkpoint.

    ``options``: a ConvertRequest (``ConvertOptions``; default: ratio 4); ``overrides``: any of its fields
    (ratio=, rank=, layout=, targets=, exclude=, allocation=, ...), validated the same way; the defaults
    left open are chosen for ``model`` by ``plan(request, model)``, recorded in the report.
    ``tokenizer`` (a tokenizer, or the folder or hub id it loads from): calibrate on the request's text,
    by default ``DEFAULT_CALIBRATION`` as `comera convert` does, in memory (the block-by-block compensation
    and reconstruction of ``convert_checkpoint`` need a checkpoint on disk); ``calibration="..."`` names
    other text, as ``--calibration`` does. ``calibration`` may also be statistics already computed
    (``calibrate(model, tokenizer, data)``). With neither, the conversion is plain
    TT-SVD, which keeps less, and a warning says so; ``uncalibrated=True`` asks for it without the
    warning. ``source``: the dense model's name, recorded for `comera eval` and distillation.
    ``progress(name, index, count)`` hears of each module; ``load(name)`` gives a module its weights just
    before it is decomposed and ``release(name)`` takes its TT module once in place (streaming conversion).
    """
    if isinstance(calibration, str):  # the text to calibrate on, as the request names it
        overrides, calibration = {**overrides, "calibration": calibration}, None
    request = with_overrides(options, overrides)
    if calibration is None and tokenizer is not None and not request.calibration:
        request = request.with_changes(calibration=DEFAULT_CALIBRATION)
    planned = plan(request, model)
    if calibration is None:
        calibration = _calibration_or_warning(model, planned, tokenizer, uncalibrated)
    hooks = ModuleHooks(progress or IN_MEMORY.progress, load, release)
    return convert_model(model, planned, calibration=calibration, source=source, hooks=hooks)


def _calibration_or_warning(model: nn.Module, planned, tokenizer, uncalibrated: bool) -> Calibration | None:
    """The statistics of the text ``planned`` names, read through ``tokenizer``; without a tokenizer, None,
    and a one-line warning unless the caller wants a plain conversion (uncalibrated=True)."""
    if tokenizer is not None:
        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(str(tokenizer), "tokenizer=")
        return calibrate_as_planned(model, tokenizer, planned)
    if planned.calibration:
        raise ConfigError(f"calibration={planned.calibration!r} needs the model's tokenizer: "
                          f"convert(model, tokenizer=...)")
    if not uncalibrated:
        warnings.warn(UNCALIBRATED_WARNING, UserWarning, stacklevel=3)
    return None


# One line: what the user gets, why, and the two ways out.
UNCALIBRATED_WARNING = ("comera_convert.convert without a tokenizer converts by plain TT-SVD, which keeps less of "
                        "the model's task than `comera convert`: pass tokenizer= to calibrate (or "
                        "uncalibrated=True to convert plainly without this warning)")


def with_overrides(options: ConvertRequest | None, overrides: dict) -> ConvertRequest:
    """``options`` (default ConvertRequest()) with ``overrides`` applied and validated."""
    request = options or ConvertRequest()
    return request.with_changes(**overrides) if overrides else request


def convert_checkpoint(model_name: str, out, options: ConvertRequest | None = None, *, task=None, overwrite=False,
                       progress: Progress | None = None, default_calibration: str | None = DEFAULT_CALIBRATION,
                       command: str | None = None, max_shard_size: int | str | None = None,
                       **overrides) -> ConversionResult:
    """Load ``model_name``, convert it with ``options`` (and ``overrides``, as ``convert`` takes them)
    and write a compressed checkpoint to ``out``: the streamed pipeline (``pipeline/run.py``, its stages in
    ``pipeline/stages/``), which never holds the dense model whole where the source is a local safetensors
    checkpoint.

    ``default_calibration``: the data to calibrate on when ``options`` names none: ``DEFAULT_CALIBRATION``,
    as `comera convert` does, so both give the same checkpoint; ``None`` converts by plain TT-SVD (as
    ``--no-calibration``). The result's ``notes`` say which, and that a model without a tokenizer
    converted plainly. Data named in ``options`` needs the tokenizer. ``command``: the command
    line that requested it, recorded in the report and the model card. ``task`` picks the head
    (``TASK_CLASSES``); by default the recorded architecture, or the encoder alone (AutoModel) for a
    sentence-transformers folder, as sentence-transformers loads it. ``progress`` hears of each
    stage (loading, calibrating, each module converted, saving). ``max_shard_size`` splits the
    weights into shards of at most that size with an index, as ``save_pretrained`` does."""
    return run_pipeline(model_name, out, with_overrides(options, overrides), task=task, overwrite=overwrite,
                        progress=progress, default_calibration=default_calibration, command=command,
                        max_shard_size=max_shard_size)


def decompress(model_name: str, out, *, overwrite=False, progress: Progress | None = None,
               max_shard_size: int | str | None = None) -> Path:
    """Write an ordinary dense checkpoint of a compressed one (atomically), with every non-weight
    file of it (sentence-transformers modules, tokenizer) and the source's model card."""
    progress = progress or no_progress
    sharding = shard_kwargs(max_shard_size)
    out = check_output_dir(out, overwrite)
    path = resolve(model_name)
    progress(f"loading {model_name}")
    model = decompress_model(from_pretrained(path))
    progress(f"saving {out}")
    with atomic_directory(out, replace_dir=True) as tmp:
        model.save_pretrained(tmp, **sharding)
        carry_files(path, tmp)
        write_dense_card(tmp, model_name, source_card(path))
    return out
