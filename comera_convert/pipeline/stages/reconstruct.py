"""Reconstruct: where the calibration runs block by block, tune each block's factors (a few Adam steps) so that
it gives the dense block's outputs on the compressed stream's inputs, once its layers are all converted
(``reconstruction.py``); on the integer grid where the checkpoint stores integers. A model converted in memory
has no block-by-block streams: there it is skipped, with a note."""

from __future__ import annotations

from ...conversion.storage import integer_storage
from ..reconstruction import BlockFit, reconstruct_block
from ..runner import Conversion, Stage


class Reconstruct(Stage):
    name = "reconstruct"

    def __init__(self):
        self.fits: list[BlockFit] = []

    def applies(self, job: Conversion) -> bool:
        return bool(job.plan.reconstruct_steps and job.plan.calibration)

    def per_block(self, job: Conversion, block) -> None:
        grid = integer_storage(job.plan.dtype, job.plan.group_size)
        self.fits.append(reconstruct_block(block.module, block.index, block.inputs, block.targets,
                                           job.plan.reconstruct_steps, job.plan.reconstruct_lr, grid=grid,
                                           earlier=self.fits))

    def finish(self, job: Conversion) -> None:
        if job.source.blockwise:
            job.report.extra["reconstruction"] = [fit.to_dict() for fit in self.fits]
        else:
            job.notes.append("block reconstruction runs in a calibrated conversion streamed block by block (a local "
                             "safetensors checkpoint with a tokenizer and a stack of blocks): it was skipped")
