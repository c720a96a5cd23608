"""The public verbs: one per job, the same ones the CLI runs.

    convert(model, options, calibration=)     a model in memory, in place -> ConversionReport
    convert_checkpoint(source, out, options)  load, (calibrate,) convert, save -> ConversionResult
    calibrate(model, tokenizer, data)         the statistics a data-aware conversion uses
    train(checkpoint, options, out)           rank-adaptive continued pre-training (`comera train`)
    evaluate(checkpoint, reference)           fidelity per domain (`comera eval`)
    from_pretrained(checkpoint)               load as the class it was saved from
    decompress(checkpoint, out)               a dense checkpoint (`comera decompress`)
    decompress_model(model)                   a model in memory, in place
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .conversion import Calibration, ConversionReport, ConvertRequest, calibrate, plan
from .conversion.hooks import IN_MEMORY, ModuleHooks
from .hf.carry import carry_files
from .hf.loading import decompress_model, from_pretrained
from .hf.model_card import source_card, write_dense_card
from .hf.saving import atomic_directory, check_output_dir, shard_kwargs
from .models import resolve
from .pipeline.run import ConversionResult, convert_model
from .pipeline.run import convert_checkpoint as run_pipeline
from .progress import Progress, no_progress

__all__ = ["ConversionResult", "calibrate", "convert", "convert_checkpoint", "decompress", "decompress_model",
           "from_pretrained"]
# train and evaluate are comera_convert.training.train and comera_convert.evaluation.evaluate,
# exported from the package as they are (importing them loads transformers' Trainer).


def convert(model: nn.Module, options: ConvertRequest | None = None, *, calibration: Calibration | None = None,
            source: str | None = None, progress=None, load=None, release=None, **overrides) -> ConversionReport:
    """Convert ``model`` in place and return the report; ``model.save_pretrained`` then writes a
    compressed checkpoint.

    ``options``: a ConvertRequest (``ConvertOptions``; default: ratio 4); ``overrides``: any of its fields
    (ratio=, rank=, layout=, targets=, exclude=, allocation=, ...), validated the same way; the defaults
    left open are chosen for ``model`` by ``plan(request, model)``, recorded in the report. ``calibration``:
    the statistics of ``calibrate(model, tokenizer, data)``. ``source``: the dense model's name,
    recorded for `comera eval` and distillation. ``progress(name, index, count)`` hears of each module;
    ``load(name)`` gives a module its weights just before it is decomposed and ``release(name)`` takes
    its TT module once in place (streaming conversion).
    """
    request = with_overrides(options, overrides)
    hooks = ModuleHooks(progress or IN_MEMORY.progress, load, release)
    return convert_model(model, plan(request, model), calibration=calibration, source=source, hooks=hooks)


def with_overrides(options: ConvertRequest | None, overrides: dict) -> ConvertRequest:
    """``options`` (default ConvertRequest()) with ``overrides`` applied and validated."""
    request = options or ConvertRequest()
    return request.with_changes(**overrides) if overrides else request


def convert_checkpoint(model_name: str, out, options: ConvertRequest | None = None, *, task=None, overwrite=False,
                       progress: Progress | None = None, default_calibration: str | None = None,
                       command: str | None = None, max_shard_size: int | str | None = None,
                       **overrides) -> ConversionResult:
    """Load ``model_name``, convert it with ``options`` (and ``overrides``, as ``convert`` takes them)
    and write a compressed checkpoint to ``out``: the streamed pipeline (``pipeline/run.py``, its stages in
    ``pipeline/stages/``), which never holds the dense model whole where the source is a local safetensors
    checkpoint.

    ``default_calibration``: the data to calibrate on when ``options`` names none (`comera convert`
    passes ``english+python-stdlib``); a model without a tokenizer then converts by plain TT-SVD, as
    the result's ``notes`` say. Data named in ``options`` needs the tokenizer. ``command``: the command
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
