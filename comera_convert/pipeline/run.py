"""A conversion from a checkpoint to a checkpoint: the checks made before anything slow, then the stages run
in order (``stages/``, by ``runner.py``), then what was written.

``convert_checkpoint`` is what ``comera convert`` and ``comera_convert.convert(..., out=...)`` run. The stages
live in ``stages/`` (allocate, read, calibrate, reconstruct, write), the module loop between them in
``factorize.py``; the sources, calibration passes, reconstruction and spool they use live beside this file,
and none of them imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..conversion import ConversionReport, ConvertRequest
from ..errors import ModelLoadError
from ..hf.saving import check_disk_space, check_output_dir, shard_kwargs, weight_bytes
from ..hf.sentence_config import check_modules, sentence_task
from ..models import load_tokenizer, read_config, resolve
from ..progress import Progress, no_progress
from .factorize import convert_model
from .runner import Conversion, run_stages
from .sources import streams
from .stages import STAGES

__all__ = ["ConversionResult", "convert_checkpoint", "convert_model"]


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
    """Convert the checkpoint ``model_name`` into ``out``: the checks that need nothing slow, then the stages in
    order (``stages.STAGES``): open the source (on the meta device where it streams: ``sources.py``), calibrate,
    then block by block compensate, factorize, reconstruct, round and spool, then assemble the checkpoint in
    ``out``. Where the source cannot stream it is loaded whole and converted in memory (the notes say why).

    ``default_calibration``: the data to calibrate on when ``options`` names none (`comera convert` and
    ``comera_convert.convert_checkpoint`` pass ``DEFAULT_CALIBRATION``), as the result's ``notes`` say; a model
    without a tokenizer then converts by plain TT-SVD, as the notes say too. Data named in ``options`` needs
    the tokenizer. ``command``: the command line that requested it, recorded in the report and the model card.
    ``task`` picks the head (``TASK_CLASSES``); by default the recorded architecture, or the encoder alone
    (AutoModel) for a sentence-transformers folder, as sentence-transformers loads it. ``progress`` hears of
    each stage (loading, calibrating, each module converted, saving). ``max_shard_size`` splits the weights
    into shards of at most that size with an index, as ``save_pretrained`` does."""
    out = check_output_dir(out, overwrite)  # fail before the slow part
    path, task, notes = _checked_source(model_name, task)
    request, tokenizer = _with_default_calibration(model_name, path, request, default_calibration, notes)
    _check_room(out, path, request)
    job = Conversion(model_name, path, out, request, task, progress or no_progress, overwrite=overwrite,
                     tokenizer=tokenizer, command=command, sharding=shard_kwargs(max_shard_size), notes=notes)
    run_stages(job, STAGES)
    job.report.extra["timings"] = job.clock.seconds
    return ConversionResult(out=out, report=job.report, timings=job.clock.seconds, disk_bytes=weight_bytes(out),
                            notes=notes)


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
    notes.append(f"calibrated on {default}, the default text (--no-calibration, or default_calibration=None in "
                 f"Python, converts by plain TT-SVD)")
    return dataclasses.replace(request, calibration=default), tokenizer


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
