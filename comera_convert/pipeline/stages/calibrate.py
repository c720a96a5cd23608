"""Calibrate: the statistics each decomposition is weighted by, where the plan names calibration text. A model
in memory is calibrated before converting; a streamed one block by block, each block's passes run as the module
loop reaches it (compensating where the plan says: ``sequential.py``, ``compensating.py``), each block closed
through the stages' ``per_block``."""

from __future__ import annotations

from ..runner import Conversion, Stage


class Calibrate(Stage):
    name = "calibrate"

    def applies(self, job: Conversion) -> bool:
        return bool(job.plan.calibration)

    def prepare(self, job: Conversion) -> None:
        job.calibration = job.source.calibration(job.plan, job.tokenizer, job.progress, job.block_closed)

    def before_module(self, job: Conversion, name: str) -> None:
        job.source.passes(name)

    def finish(self, job: Conversion) -> None:
        job.source.finish_calibration()
