"""The streamed conversion pipeline, run in one place: the stages in order, the options passed down.

``convert_checkpoint`` opens the source, plans the calibration, converts block by block (each block
calibrated, compensated, factorized, reconstructed, rounded and spooled as the conversion reaches
it) and assembles the checkpoint; ``convert_model`` is the in-memory conversion it and
``comera_convert.convert`` share. The stages themselves live beside this file (``streaming``,
``sequential``, ``compensating``, ``reconstruction``, ``spool``) and never call back up here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ..conversion import Calibration, ConversionReport, ConvertOptions, calibrate, convert_modules
from ..conversion.model_facts import count_params
from ..conversion.report import lineage
from ..conversion.storage import cast_for_storage, integer_storage, round_in_place, storage_record
from ..hf.compat import untie_converted_heads
from ..hf.config import ComeraConfig
from ..hf.saving import check_disk_space, check_output_dir, save_compressed, shard_kwargs, weight_bytes
from ..hf.sentence_config import check_modules, sentence_task
from ..models import load_model, read_config, resolve
from ..progress import Progress, no_progress


def convert_model(model: nn.Module, options: ConvertOptions, *, calibration: Calibration | None = None,
                  source: str | None = None, progress=None, load=None, release=None) -> ConversionReport:
    """Convert ``model`` in place with validated ``options`` (``comera_convert.convert`` is the public
    verb): the in-place swap (``conversion``), the heads untied from converted tables, integer
    rounding of what is left dense, and the marks that make it save and load as a compressed model.
    ``load(name)`` gives a module its weights just before it is decomposed and ``release(name)`` takes
    its TT module once in place (the streamed stages pass both)."""
    options = options.for_model(model)
    report = convert_modules(model, options, calibration=calibration, progress=progress, source=source, load=load,
                             release=release)
    if options.cut is not None and math.isfinite(options.cut):
        report.extra["layers_cut"] = round(options.cut, 3)
    untie_converted_heads(model)
    fmt = integer_storage(options.dtype, options.group_size)
    if fmt is not None:  # the layers left dense too: in memory the model is what its checkpoint holds
        round_in_place(model, fmt)
    storage = storage_record(options.dtype, options.group_size) if fmt is not None else None
    from ..hf.quantizer import mark_converted  # transformers' quantizers: loaded when a model is converted

    mark_converted(model, ComeraConfig(source=source, dense_params=report.params_before, storage=storage))
    return report


def storage_name(options: ConvertOptions) -> str | None:
    """How an integer-stored checkpoint's report names its storage ("int4, groups of 128"), or None."""
    fmt = integer_storage(options.dtype, options.group_size)
    if fmt is None:
        return None
    return fmt.name + (f", groups of {fmt.group_size}" if fmt.group_size else ", a scale per channel")


@dataclass
class ConversionResult:
    """What ``convert_checkpoint`` wrote: the folder, its report, the seconds of each stage, its bytes on disk and
    the notes the user should read (a default that could not apply)."""
    out: Path
    report: ConversionReport
    timings: dict[str, float]
    disk_bytes: int
    notes: list[str] = field(default_factory=list)  # what the user should know (a skipped default)


def convert_checkpoint(model_name: str, out, options: ConvertOptions, *, task=None, overwrite=False,
                       progress: Progress | None = None, default_calibration: str | None = None,
                       command: str | None = None, max_shard_size: int | str | None = None) -> ConversionResult:
    """The streamed conversion, its stages in order: open the source (on the meta device where it
    streams), plan the calibration, then block by block calibrate, compensate, factorize,
    reconstruct, round and spool, then assemble the checkpoint in ``out`` from the spool. Where the
    source cannot stream it is loaded whole and converted in memory (the notes say why).

    ``default_calibration``: the data to calibrate on when ``options`` names none (`comera convert`
    passes ``english``); a model without a tokenizer then converts by plain TT-SVD, as the
    result's ``notes`` say. Data named in ``options`` needs the tokenizer. ``command``: the command
    line that requested it, recorded in the report and the model card. ``task`` picks the head
    (``TASK_CLASSES``); by default the recorded architecture, or the encoder alone (AutoModel) for a
    sentence-transformers folder, as sentence-transformers loads it. ``progress`` hears of each
    stage (loading, calibrating, each module converted, saving). ``max_shard_size`` splits the
    weights into shards of at most that size with an index, as ``save_pretrained`` does."""
    progress = progress or no_progress
    sharding = shard_kwargs(max_shard_size)
    out = check_output_dir(out, overwrite)  # fail before the slow part
    path = resolve(model_name)
    read_config(path)  # a hub id neither cached nor reachable fails here, before the tokenizer's retries
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
    learning, allocating = None, 0.0
    if options.allocation == "learned" and options.rank_scales is None:
        options, learning = _learn_allocation(model_name, path, options, task, tokenizer, progress)
        allocating = time.perf_counter() - start  # the dense model loaded whole, the text read, the ranks learned
    model, path, streamed, sequential, options = _open_source(model_name, path, options, task, tokenizer, notes,
                                                              progress)
    loaded = time.perf_counter()
    start += allocating  # its own stage
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
        report = convert_model(model, options, calibration=calibration, source=model_name,
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
        stored = storage_name(options) or str(next(model.parameters()).dtype).removeprefix("torch.")
        report.extra["storage_dtype"] = stored
        report.extra["source_bytes"] = weight_bytes(path)
        if learning is not None:
            report.extra.update(learning.to_dict())
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
    if learning is not None:
        timings["allocate"] = allocating
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
    """Whether this conversion streams: one of a local safetensors checkpoint whose allocation needs no
    model in memory (uniform, or learned with its scales known)."""
    from .streaming import streamable

    known = options.allocation == "uniform" or (options.allocation == "learned" and options.rank_scales is not None)
    return known and streamable(path)


def _learn_allocation(model_name: str, path: str, options: ConvertOptions, task, tokenizer, progress):
    """(options with the learned ``rank_scales``, the learning): the dense model loaded whole and the
    learned allocation's ranks learned on ``LEARNING_SEQUENCES`` of the calibration text, before the
    conversion streams with them."""
    import torch

    from ..conversion.calibration import plan_calibration
    from ..conversion.converter import allocation_request
    from ..conversion.learned import LEARNING_SEQUENCES, STEP_SEQUENCES
    from ..conversion.strategies import learn_allocation
    from ..errors import ConfigError
    from ..models import load_tokenizer

    if not options.calibration:
        raise ConfigError("allocation 'learned' learns the ranks on calibration text: give --calibration DATA "
                          "(without --no-calibration), or rank_scales learned before")
    progress(f"learning the rank allocation on {options.calibration}")
    model, _ = load_model(path, task=task)
    request = allocation_request(model, options.for_model(model))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path, "--allocation learned")
    plan = plan_calibration(model, request.candidates, tokenizer, options.calibration, LEARNING_SEQUENCES,
                            options.calibration_seq_len)
    learning = learn_allocation(request, list(torch.cat(plan.batches).split(STEP_SEQUENCES)))
    return options.replace(rank_scales=learning.scales), learning


def _stream_source(path: str, options: ConvertOptions):
    """The streaming reader of the checkpoint where the conversion streams; None otherwise."""
    from .streaming import Streamed

    return Streamed(path) if _streams(path, options) else None


# A conversion of a model loaded whole peaks at about twice its checkpoint's bytes (measured on a
# 1.1 B bfloat16 model: 4.45 GB for 2.2 GB). BENCHMARKS.md#conversion-time-and-memory
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
    from ..conversion.calibration import plan_calibration
    from ..conversion.targets import find_blocks, find_candidates
    from .compensating import CompensatingCalibration
    from .sequential import SequentialCalibration
    from ..models import load_tokenizer

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
    from ..errors import ModelLoadError
    from ..models import load_tokenizer

    try:
        return load_tokenizer(path, "calibration")
    except ModelLoadError:
        return None


def _calibration(model, path, options: ConvertOptions, tokenizer=None):
    """Calibration statistics on ``options.calibration``, with ``tokenizer`` when it was loaded already."""
    from ..models import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path, "--calibration")
    return calibrate(model, tokenizer, options.calibration, options.sequences_for(count_params(model)),
                     options.calibration_seq_len, options.targets, options.exclude, options.d)
