"""Allocate: with ``--allocation learned`` and no ranks learned before, learn them first, on the dense model
loaded whole and the calibration text, so that the conversion then streams with them."""

from __future__ import annotations

import dataclasses

import torch

from ...conversion import plan
from ...conversion.calibration import plan_calibration
from ...conversion.converter import allocation_request
from ...conversion.learned import LEARNING_SEQUENCES, STEP_SEQUENCES
from ...conversion.strategies import learn_allocation
from ...errors import ConfigError
from ...models import load_model, load_tokenizer
from ..runner import Conversion, Stage


class Allocate(Stage):
    name = "allocate"

    def __init__(self):
        self.learning = None

    def applies(self, job: Conversion) -> bool:
        return job.request.allocation == "learned" and job.request.rank_scales is None

    def prepare(self, job: Conversion) -> None:
        """The request with the learned ``rank_scales``; the learning kept for the report."""
        request = job.request
        if not request.calibration:
            raise ConfigError("allocation 'learned' learns the ranks on calibration text: give --calibration DATA "
                              "(without --no-calibration), or rank_scales learned before")
        job.progress(f"learning the rank allocation on {request.calibration}")
        model, _ = load_model(job.path, task=job.task)
        budget = allocation_request(model, plan(request, model))
        tokenizer = job.tokenizer if job.tokenizer is not None else load_tokenizer(job.path, "--allocation learned")
        text = plan_calibration(model, budget.candidates, tokenizer, request.calibration, LEARNING_SEQUENCES,
                                request.calibration_seq_len)
        self.learning = learn_allocation(budget, list(torch.cat(text.batches).split(STEP_SEQUENCES)))
        job.request = dataclasses.replace(request, rank_scales=self.learning.scales)

    def finish(self, job: Conversion) -> None:
        job.report.extra.update(self.learning.to_dict())
