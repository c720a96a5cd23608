"""The streamed conversion pipeline, run in one place: the stages in order, the options passed down.

``convert_checkpoint`` opens the source, plans the calibration, converts block by block (each block
calibrated, compensated, factorized, reconstructed, rounded and spooled as the conversion reaches
it) and assembles the checkpoint; ``convert_model`` is the in-memory conversion it and
``comera_convert.convert`` share. The stages themselves live beside this file (``streaming``,
``sequential``, ``compensating``, ``reconstruction``, ``spool``) and never call back up here.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ..conversion import Calibration, ConversionReport, ConvertPlan, ConvertRequest, convert_modules, plan
from ..conversion.calibration import plan_calibration
from ..conversion.hooks import IN_MEMORY, ModuleHooks
from ..conversion.converter import allocation_request
from ..conversion.learned import LEARNING_SEQUENCES, STEP_SEQUENCES
from ..conversion.plan import finite_cut
from ..conversion.report import lineage
from ..conversion.storage import integer_storage, round_in_place, storage_record
from ..conversion.strategies import learn_allocation
from ..errors import ConfigError, ModelLoadError
from ..hf.compat import untie_converted_heads
from ..hf.config import ComeraConfig
from ..hf.saving import check_disk_space, check_output_dir, save_compressed, shard_kwargs, weight_bytes
from ..hf.sentence_config import check_modules, sentence_task
from ..models import load_model, load_tokenizer, read_config, resolve
from ..progress import Progress, no_progress
from .sources import open_source, streams


def convert_model(model: nn.Module, options: ConvertPlan, *, calibration: Calibration | None = None,
                  source: str | None = None, hooks: ModuleHooks = IN_MEMORY) -> ConversionReport:
    """Convert ``model`` in place as ``options`` (the request's plan for it) say (``comera_convert.convert``
    is the public verb): the in-place swap (``conversion``), the heads untied from converted tables, integer
    rounding of what is left dense, and the marks that make it save and load as a compressed model.
    ``hooks``: who hears of each module and, streaming, hands its weights in and takes it out."""
    report = convert_modules(model, options, calibration=calibration, hooks=hooks, source=source)
    report.extra["plan"] = options.describe()
    if finite_cut(options) is not None:
        report.extra["layers_cut"] = finite_cut(options)
    untie_converted_heads(model)
    fmt = integer_storage(options.dtype, options.group_size)
    if fmt is not None:  # the layers left dense too: in memory the model is what its checkpoint holds
        round_in_place(model, fmt)
    storage = storage_record(options.dtype, options.group_size) if fmt is not None else None
    # Imported here: importing it loads transformers' quantizers, whose loading registers the "comera" method
    # from this very module (hf/registration.py), so it must not load while this module does.
    from ..hf.quantizer import mark_converted

    mark_converted(model, ComeraConfig(source=source, dense_params=report.params_before, storage=storage))
    return report


def storage_name(options: ConvertPlan) -> str | None:
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


def convert_checkpoint(model_name: str, out, request: ConvertRequest, *, task=None, overwrite=False,
                       progress: Progress | None = None, default_calibration: str | None = None,
                       command: str | None = None, max_shard_size: int | str | None = None) -> ConversionResult:
    """The streamed conversion, its stages in order: open the source (on the meta device where it
    streams: ``sources.py``), calibrate, then block by block compensate, factorize, reconstruct, round
    and spool, then assemble the checkpoint in ``out`` from the spool. Where the source cannot stream
    it is loaded whole and converted in memory (the notes say why).

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
    path, task, notes = _checked_source(model_name, task)
    clock = Stopwatch()
    request, tokenizer = _with_default_calibration(model_name, path, request, default_calibration, notes)
    progress(f"loading {model_name}")
    _check_room(out, path, request)
    learning = None
    if request.allocation == "learned" and request.rank_scales is None:
        request, learning = _learn_allocation(model_name, path, request, task, tokenizer, progress)
        clock.lap("allocate")  # the dense model loaded whole, the text read, the ranks learned
    source, options = open_source(model_name, path, request, task, tokenizer, notes, progress)
    clock.lap("load")
    calibration = source.calibration(options, tokenizer, progress)
    clock.lap("calibrate")
    try:
        report = _convert(source, out, options, calibration, model_name, notes, progress)
        _record(report, source, options, learning, command)
        clock.lap("convert")
        progress(f"saving {out}")
        save_compressed(source.model, out, report=report, source=source.path, overwrite=overwrite, replace_dir=True,
                        write_weights=source.writer(sharding.get("max_shard_size")), **sharding)
        clock.lap("save")
    finally:
        source.close()
    report.extra["timings"] = timings = source.settle(clock.seconds, calibrated=calibration is not None)
    return ConversionResult(out=out, report=report, timings=timings, disk_bytes=weight_bytes(out), notes=notes)


class Stopwatch:
    """Seconds per stage: each ``lap(name)`` adds the time since the last lap to that stage."""

    def __init__(self):
        self.mark, self.seconds = time.perf_counter(), {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.mark
        self.mark = now


def _checked_source(model_name: str, task) -> tuple[str, str | None, list[str]]:
    """(path, task, notes): the source found and its config read, before anything slow; a sentence-transformers
    folder converts as its encoder, as sentence-transformers loads it."""
    path = resolve(model_name)
    config = read_config(path)  # a hub id neither cached nor reachable fails here, before the tokenizer's retries
    check_modules(path)  # a sentence-transformers config that could never load
    if task is not None:
        return path, task, []
    task = sentence_task(path)
    heads = [a for a in config.get("architectures") or () if "For" in a] if task else []
    if not heads:
        return path, task, []
    return path, task, [f"{model_name} is a sentence-transformers model: converted as its encoder (AutoModel), as "
                        f"sentence-transformers loads it, without the {heads[0]} head its config records (--task "
                        f"keeps a head)"]


def _with_default_calibration(model_name: str, path: str, request: ConvertRequest, default: str | None,
                              notes: list[str]):
    """(request, tokenizer or None): ``default`` as the calibration data where the request names none and the
    model has a tokenizer; without one, a note that it converts by plain TT-SVD."""
    if request.calibration is not None or default is None:
        return request, None
    tokenizer = _tokenizer_or_none(path)
    if tokenizer is None:
        notes.append(f"{model_name} has no tokenizer files, so it was converted without calibration "
                     f"(plain TT-SVD); copy its tokenizer in for a data-aware conversion")
        return request, None
    return dataclasses.replace(request, calibration=default), tokenizer


def _convert(source, out, options: ConvertPlan, calibration, model_name: str, notes: list[str],
             progress) -> ConversionReport:
    """The modules converted as the source hands them over, and the model left as its checkpoint stores it."""
    source.begin(out, options)
    hooks = source.hooks(lambda name, index, total: progress(f"converting {name}", index, total))
    report = convert_model(source.model, options, calibration=calibration, source=model_name, hooks=hooks)
    source.finish(report, options, notes)
    return report


def _record(report: ConversionReport, source, options: ConvertPlan, learning, command: str | None) -> None:
    """What the report keeps of how the checkpoint was made."""
    dtype = str(next(source.model.parameters()).dtype).removeprefix("torch.")
    report.extra["storage_dtype"] = storage_name(options) or dtype
    report.extra["source_bytes"] = weight_bytes(source.path)
    if learning is not None:
        report.extra.update(learning.to_dict())
    report.extra.update(lineage(None, command))


def _learn_allocation(model_name: str, path: str, request: ConvertRequest, task, tokenizer, progress):
    """(the request with the learned ``rank_scales``, the learning): the dense model loaded whole and the
    learned allocation's ranks learned on ``LEARNING_SEQUENCES`` of the calibration text, before the
    conversion streams with them."""
    import torch

    if not request.calibration:
        raise ConfigError("allocation 'learned' learns the ranks on calibration text: give --calibration DATA "
                          "(without --no-calibration), or rank_scales learned before")
    progress(f"learning the rank allocation on {request.calibration}")
    model, _ = load_model(path, task=task)
    budget = allocation_request(model, plan(request, model))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path, "--allocation learned")
    text = plan_calibration(model, budget.candidates, tokenizer, request.calibration, LEARNING_SEQUENCES,
                            request.calibration_seq_len)
    learning = learn_allocation(budget, list(torch.cat(text.batches).split(STEP_SEQUENCES)))
    return dataclasses.replace(request, rank_scales=learning.scales), learning


def _check_room(out: Path, path: str, request: ConvertRequest) -> None:
    """Refuse a conversion whose output the disk cannot hold, before the slow part: the source's
    weight bytes over the ratio (all of them for a fixed rank), twice over when streaming (the
    spool, then the checkpoint assembled from it)."""
    source = weight_bytes(path)
    if not source:
        return  # not a local folder: its size is not known before loading
    spooled, ratio = streams(path, request), request.budget_ratio
    estimate = source / ratio if ratio else source
    copies = 2 if spooled else 1
    what = (f"{source / 1e9:.2f} GB of weights" + (f" / ratio {ratio:g}" if ratio else "")
            + (", written twice: spooled as converted, then assembled" if spooled else ""))
    check_disk_space(out, int(estimate * copies), what)


def _tokenizer_or_none(path: str):
    """The model's tokenizer, or None where it has no tokenizer files."""
    try:
        return load_tokenizer(path, "calibration")
    except ModelLoadError:
        return None
