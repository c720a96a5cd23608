"""Read: open the source (loaded whole, streamed, or streamed and calibrated block by block: ``sources.py``) and
plan the conversion for its model; where it streams, read each module's weights just before it is decomposed."""

from __future__ import annotations

from ..runner import Conversion, Stage
from ..sources import open_source


class Read(Stage):
    name = "load"

    def prepare(self, job: Conversion) -> None:
        job.progress(f"loading {job.model_name}")
        job.source, job.plan = open_source(job.model_name, job.path, job.request, job.task, job.notes)
        job.closing.callback(job.source.close)

    def before_module(self, job: Conversion, name: str) -> None:
        job.source.load(name)
