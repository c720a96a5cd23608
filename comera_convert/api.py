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

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from .conversion import Calibration, ConversionReport, ConvertOptions, calibrate, convert_modules
from .conversion.converter import count_params
from .conversion.report import lineage
from .conversion.storage import cast_for_storage, integer_storage, round_in_place, storage_record
from .hf.compat import mark_compressed, untie_converted_heads
from .hf.config import ComeraConfig
from .hf.loading import decompress_model, from_pretrained
from .hf.saving import check_disk_space, check_output_dir, save_compressed, shard_kwargs, weight_bytes
from .hf.sentence_config import check_modules, sentence_task
from .models import load_model, read_config, resolve
from .option_files import from_mapping
from .progress import Progress, no_progress

__all__ = ["ConversionResult", "calibrate", "convert", "convert_checkpoint", "decompress", "decompress_model",
           "from_pretrained"]
# train and evaluate are comera_convert.training.train and comera_convert.evaluation.evaluate,
# exported from the package as they are (importing them loads transformers' Trainer).


def convert(model: nn.Module, options: ConvertOptions | None = None, *, calibration: Calibration | None = None,
            source: str | None = None, progress=None, load=None, release=None, **overrides) -> ConversionReport:
    """Convert ``model`` in place and return the report; ``model.save_pretrained`` then writes a
    compressed checkpoint.

    ``options``: a ConvertOptions (default: ratio 4); ``overrides``: any of its fields (ratio=,
    rank=, layout=, targets=, exclude=, allocation=, ...), validated the same way. ``calibration``:
    the statistics of ``calibrate(model, tokenizer, data)``. ``source``: the dense model's name,
    recorded for `comera eval` and distillation. ``progress(name, index, count)`` hears of each module;
    ``load(name)`` gives a module its weights just before it is decomposed and ``release(name)`` takes
    its TT module once in place (streaming conversion).
    """
    options = with_overrides(options, overrides).for_model(model)
    report = convert_modules(model, options, calibration=calibration, progress=progress, source=source, load=load,
                             release=release)
    if options.cut is not None and math.isfinite(options.cut):
        report.extra["layers_cut"] = round(options.cut, 3)
    untie_converted_heads(model)
    fmt = integer_storage(options.dtype, options.group_size)
    if fmt is not None:  # the layers left dense too: in memory the model is what its checkpoint holds
        round_in_place(model, fmt)
    storage = storage_record(options.dtype, options.group_size) if fmt is not None else None
    mark_compressed(model, ComeraConfig(source=source, dense_params=report.params_before, storage=storage))
    return report


def storage_name(options: ConvertOptions) -> str | None:
    """How an integer-stored checkpoint's report names its storage ("int4, groups of 128"), or None."""
    fmt = integer_storage(options.dtype, options.group_size)
    if fmt is None:
        return None
    return fmt.name + (f", groups of {fmt.group_size}" if fmt.group_size else ", a scale per channel")




def with_overrides(options: ConvertOptions | None, overrides: dict) -> ConvertOptions:
    """``options`` (default ConvertOptions()) with ``overrides`` applied and validated; a fixed rank
    given as an override replaces the default ratio."""
    if not overrides:
        return options or ConvertOptions()
    # Only what was given is carried over: the defaults that depend on others (the modes on the ratio
    # and the table, compensation on the layers' cut) are chosen for the final values.
    base = {**dataclasses.asdict(options), **options.defaulted()} if options is not None else {}
    if overrides.get("rank") is not None and "ratio" not in overrides:
        base["ratio"] = None
    return from_mapping(ConvertOptions, {**base, **overrides}, "convert()")


@dataclass
class ConversionResult:
    """What ``convert_checkpoint`` wrote: the folder, its report, the seconds of each stage, its bytes on disk and
    the notes the user should read (a default that could not apply)."""
    out: Path
    report: ConversionReport
    timings: dict[str, float]
    disk_bytes: int
    notes: list[str] = field(default_factory=list)  # what the user should know (a skipped default)


def convert_checkpoint(model_name: str, out, options: ConvertOptions | None = None, *, task=None, overwrite=False,
                       progress: Progress | None = None, default_calibration: str | None = None,
                       command: str | None = None, max_shard_size: int | str | None = None,
                       **overrides) -> ConversionResult:
    """Load ``model_name``, convert it with ``options`` (and ``overrides``, as ``convert`` takes them)
    and write a compressed checkpoint to ``out``.

    ``default_calibration``: the data to calibrate on when ``options`` names none (`comera convert`
    passes ``english``); a model without a tokenizer then converts by plain TT-SVD, as the
    result's ``notes`` say. Data named in ``options`` needs the tokenizer. ``command``: the command
    line that asked for it, recorded in the report and the model card. ``task`` picks the head
    (``TASK_CLASSES``); by default the recorded architecture, or the encoder alone (AutoModel) for a
    sentence-transformers folder, as sentence-transformers loads it. ``progress`` hears of each
    stage (loading, calibrating, each module converted, saving). ``max_shard_size`` splits the
    weights into shards of at most that size with an index, as ``save_pretrained`` does."""
    progress = progress or no_progress
    options = with_overrides(options, overrides)
    sharding = shard_kwargs(max_shard_size)
    out = check_output_dir(out, overwrite)  # fail before the slow part
    path = resolve(model_name)
    check_modules(path)  # a sentence-transformers config that could never load
    notes, tokenizer = [], None
    if task is None:
        task = sentence_task(path)  # a sentence-transformers folder converts as its encoder
        heads = [a for a in read_config(path).get("architectures") or () if "For" in a] if task else []
        if heads:
            notes.append(f"{model_name} is a sentence-transformers model: converted as its encoder (AutoModel), "
                         f"as sentence-transformers loads it, without the {heads[0]} head its config records "
                         f"(--task keeps a head)")
    start = time.perf_counter()
    if options.calibration is None and default_calibration is not None:
        tokenizer = _tokenizer_or_none(path)
        if tokenizer is not None:
            options = options.replace(calibration=default_calibration)
        else:
            notes.append(f"{model_name} has no tokenizer files, so it was converted without calibration "
                         f"(plain TT-SVD); copy its tokenizer in for a data-aware conversion")
    progress(f"loading {model_name}")
    _check_room(out, path, options)
    model, path, streamed, sequential, options = _open_source(model_name, path, options, task, tokenizer, notes,
                                                              progress)
    loaded = time.perf_counter()
    if sequential is not None:
        calibration = sequential.stats  # filled block by block as the conversion reaches each block
    elif options.calibration:
        progress(f"calibrating on {options.calibration}")
        calibration = _calibration(model, path, options, tokenizer)
    else:
        calibration = None
    calibrated = time.perf_counter()
    try:
        if streamed is not None:
            streamed.open_spool(out, options.dtype, integer_storage(options.dtype, options.group_size))
        load, release = None, None
        if sequential is not None:
            load, release = sequential.prepare, sequential.release
        elif streamed is not None:
            load, release = streamed.loader(model), streamed.releaser(model)
        report = convert(model, options, calibration=calibration, source=model_name,
                         progress=lambda name, index, total: progress(f"converting {name}", index, total),
                         load=load, release=release)
        if sequential is not None:
            sequential.finish()
            if sequential.fits:
                report.extra["reconstruction"] = [fit.to_dict() for fit in sequential.fits]
        elif options.reconstruct_steps and options.calibration:
            notes.append("block reconstruction runs in a calibrated conversion streamed block by block (a local "
                         "safetensors checkpoint with a tokenizer and a stack of blocks): it was skipped")
        if streamed is not None:
            streamed.finish(model)
            report.extra["streamed"] = True
        elif options.dtype is not None:
            cast_for_storage(model, options.dtype)
        report.extra["storage_dtype"] = storage_name(options) or str(next(model.parameters()).dtype).removeprefix("torch.")
        report.extra["source_bytes"] = weight_bytes(path)
        report.extra.update(lineage(None, command))
        converted = time.perf_counter()
        progress(f"saving {out}")
        write_weights = streamed.writer(model, sharding.get("max_shard_size")) if streamed is not None else None
        save_compressed(model, out, report=report, source=path, overwrite=overwrite, replace_dir=True,
                        write_weights=write_weights, **sharding)
    finally:
        if streamed is not None:
            streamed.close()
    saved = time.perf_counter()
    timings = {"load": loaded - start, "convert": converted - calibrated, "save": saved - converted}
    if sequential is not None:  # block by block: the text was read while loading, the passes ran in the conversion
        timings["calibrate"] = sequential.reading_seconds + sequential.seconds
        timings["load"] -= sequential.reading_seconds
        timings["convert"] -= sequential.seconds
    elif calibration is not None:
        timings["calibrate"] = calibrated - loaded
    report.extra["timings"] = timings
    return ConversionResult(out=out, report=report, timings=timings, disk_bytes=weight_bytes(out),
                            notes=notes)


def _open_source(model_name: str, path: str, options: ConvertOptions, task, tokenizer, notes: list[str], progress):
    """(model, path, streamed, sequential, options): the model on the meta device with its streaming
    reader (and, calibrating, its block-by-block calibration) where it can stream; else loaded
    whole, with a note saying why and how much memory that takes. The options come back with their
    defaults chosen for the model's shape (``ConvertOptions.for_model``)."""
    streamed = _stream_source(path, options)
    if streamed is not None:
        model = streamed.skeleton(task)
        options = options.for_model(model)
        unstored = streamed.missing(model)
        if unstored:
            notes.append(f"{model_name} stores {unstored[0]} (and {len(unstored) - 1} more) under other names, "
                         f"which transformers converts on load: it was loaded whole instead of streamed"
                         f"{_whole_load_memory(path)}")
        elif not options.calibration:
            return model, path, streamed, None, options
        else:
            progress(f"calibrating on {options.calibration}, block by block")
            sequential = _sequential_calibration(model, streamed, path, options, tokenizer)
            if sequential is not None:
                return model, path, streamed, sequential, options
            notes.append(f"{model_name} has no stack of repeated blocks to calibrate one at a time: it was loaded "
                         f"whole{_whole_load_memory(path)}")
    model, path = load_model(model_name, task=task)
    return model, path, None, None, options.for_model(model)


def _streams(path: str, options: ConvertOptions) -> bool:
    """Whether this conversion streams: a uniformly allocated one of a local safetensors checkpoint."""
    from .hf.streaming import streamable

    return options.allocation == "uniform" and streamable(path)


def _stream_source(path: str, options: ConvertOptions):
    """The streaming reader of the checkpoint where the conversion streams; None otherwise."""
    from .hf.streaming import Streamed

    return Streamed(path) if _streams(path, options) else None


# A conversion of a model loaded whole peaks at about twice its checkpoint's bytes (measured on a
# 1.1 B bfloat16 model: 4.45 GB for 2.2 GB; BENCHMARKS.md, Streaming conversion).
WHOLE_LOAD_MEMORY = 2.0


def _whole_load_memory(path: str) -> str:
    source = weight_bytes(path)
    return f" (about {WHOLE_LOAD_MEMORY * source / 1e9:.1f} GB of memory)" if source else ""


def _check_room(out: Path, path: str, options: ConvertOptions) -> None:
    """Refuse a conversion whose output the disk cannot hold, before the slow part: the source's
    weight bytes over the ratio (all of them for a fixed rank), twice over when streaming (the
    spool, then the checkpoint assembled from it)."""
    source = weight_bytes(path)
    if not source:
        return  # not a local folder: its size is not known before loading
    spooled = _streams(path, options)
    estimate = source / options.ratio if options.ratio else source
    copies = 2 if spooled else 1
    what = (f"{source / 1e9:.2f} GB of weights" + (f" / ratio {options.ratio:g}" if options.ratio else "")
            + (", written twice: spooled as converted, then assembled" if spooled else ""))
    check_disk_space(out, int(estimate * copies), what)


def _sequential_calibration(model, streamed, path, options: ConvertOptions, tokenizer=None):
    """A calibration run block by block as a streamed conversion reaches each block, or None where
    the model has no stack of blocks."""
    from .conversion.calibration import plan_calibration
    from .conversion.targets import find_blocks, find_candidates
    from .hf.compensating import CompensatingCalibration
    from .hf.sequential import SequentialCalibration
    from .models import load_tokenizer

    blocks = find_blocks(model)
    if blocks is None:
        return None
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path, "--calibration")
    candidates = find_candidates(model, options.targets, options.exclude, options.d)[0]
    began = time.perf_counter()
    plan = plan_calibration(model, candidates, tokenizer, options.calibration,
                            options.sequences_for(count_params(model)), options.calibration_seq_len)
    common = dict(reading_seconds=time.perf_counter() - began)
    if options.compensate or options.reconstruct_steps:  # reconstruction needs the compressed stream too
        steps = options.reconstruct_steps_for(sum(p.numel() for p in model.get_submodule(blocks)[0].parameters()))
        reconstruct = (steps, options.reconstruct_lr) if steps else None
        return CompensatingCalibration(model, streamed, plan, candidates, blocks, options.calibration,
                                       fit_to_compressed=options.compensate, reconstruct=reconstruct,
                                       grid=integer_storage(options.dtype, options.group_size), **common)
    return SequentialCalibration(model, streamed, plan, candidates, blocks, options.calibration, **common)


def _tokenizer_or_none(path: str):
    """The model's tokenizer, or None where it has no tokenizer files."""
    from .errors import ModelLoadError
    from .models import load_tokenizer

    try:
        return load_tokenizer(path, "calibration")
    except ModelLoadError:
        return None


def _calibration(model, path, options: ConvertOptions, tokenizer=None):
    """Calibration statistics on ``options.calibration``, with ``tokenizer`` when it was loaded already."""
    from .models import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path, "--calibration")
    return calibrate(model, tokenizer, options.calibration, options.sequences_for(count_params(model)),
                     options.calibration_seq_len, options.targets, options.exclude, options.d)


def decompress(model_name: str, out, *, overwrite=False, progress: Progress | None = None,
               max_shard_size: int | str | None = None) -> Path:
    """Write an ordinary dense checkpoint of a compressed one (atomically), with every non-weight
    file of it (sentence-transformers modules, tokenizer) and the source's model card."""
    from .hf.carry import carry_files
    from .hf.model_card import source_card, write_dense_card
    from .hf.saving import atomic_directory

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
