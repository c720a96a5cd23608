"""The conversion's stages run in order by one runner, each with the same lifecycle.

A stage (``stages/``) is a class with a ``name`` (the timing the user reads) and these steps, each a no-op
unless it has work there; each conversion makes its own instance, so a stage may keep what it gathers:

- ``prepare(job)``: before the first module is converted (open the source, learn an allocation, calibrate
  a model in memory, open the spool);
- ``before_module(job, name)`` / ``after_module(job, name)``: around each module the converter decomposes,
  where the weights stream (read it, run the calibration passes up to its block, write it out);
- ``per_block(job, block)``: where the calibration runs block by block, once a block's layers are all
  converted, before the compressed stream moves past it (tune it to the dense block's outputs);
- ``finish(job)``: after the last module (the blocks left, the report's records, the checkpoint written).

``applies(job)`` leaves out a stage with nothing to do for this conversion (no learned allocation, no
calibration), so that its seconds are not reported. Between the preparing and the finishing, the converter's
own module loop (``convert_model``: factorize, dispatched by layer kind, rounded for integer storage) runs
once, with the stages' module steps as its hooks. Each step is timed as its stage's; a step run inside the
module loop is taken out of the loop's seconds (``StageClock``).
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..conversion import ConversionReport, ConvertPlan, ConvertRequest
from ..conversion.hooks import ModuleHooks
from ..progress import Progress
from .factorize import convert_model

CONVERT = "convert"  # the module loop's own seconds


class StageClock:
    """Seconds per stage. A stage timed inside another is charged to itself alone: the outer stage keeps its own
    seconds (a calibration pass run as the module loop reaches a block counts as calibrating, not converting)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._nested: list[float] = []  # per open stage: the seconds of the stages timed inside it

    @contextmanager
    def stage(self, name: str):
        began = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - began
            inner = self._nested.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - inner
            if self._nested:
                self._nested[-1] += elapsed


class Stage:
    """One step of a conversion; every lifecycle step does nothing unless a stage says otherwise."""

    name = "stage"

    def applies(self, job: "Conversion") -> bool:
        return True

    def prepare(self, job: "Conversion") -> None:
        """Before the first module is converted."""

    def before_module(self, job: "Conversion", name: str) -> None:
        """Streaming: just before module ``name``'s weights are decomposed."""

    def after_module(self, job: "Conversion", name: str) -> None:
        """Streaming: once module ``name``'s compressed module is in place."""

    def per_block(self, job: "Conversion", block) -> None:
        """Block by block: ``block`` (``compensating.ClosingBlock``) has all its layers converted."""

    def finish(self, job: "Conversion") -> None:
        """After the last module."""


@dataclass
class Conversion:
    """What the stages share: the request, what they found and made so far, and the clock.

    ``source`` is set by the reading stage (``stages/read.py``) with ``plan``; ``calibration`` by the
    calibrating stage; ``report`` by the module loop. ``stages`` are those that apply, in order, as they are
    prepared. ``closing`` holds what must be released however the conversion ends (the source's open files)."""

    model_name: str
    path: str
    out: Path
    request: ConvertRequest
    task: Any
    progress: Progress
    overwrite: bool = False
    tokenizer: Any = None
    command: str | None = None
    sharding: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    source: Any = None
    plan: ConvertPlan | None = None
    calibration: Any = None
    report: ConversionReport | None = None
    stages: list[Stage] = field(default_factory=list)
    clock: StageClock = field(default_factory=StageClock)
    closing: ExitStack = field(default_factory=ExitStack)

    def each(self, step: str, *args) -> None:
        """``step`` of every stage that applies, in order, each timed as its stage's."""
        for stage in self.stages:
            with self.clock.stage(stage.name):
                getattr(stage, step)(self, *args)

    def block_closed(self, block) -> None:
        """What the calibration calls as it closes a block: every stage's ``per_block``."""
        self.each("per_block", block)


def run_stages(job: Conversion, stage_classes) -> None:
    """Make each stage, and prepare those that apply, in order; run the module loop (``convert_model``) once,
    with the stages' module steps as its hooks; finish each stage, in the same order. What the stages hold
    open is released however it ends."""
    with job.closing:
        for cls in stage_classes:
            stage = cls()
            if stage.applies(job):
                job.stages.append(stage)
                with job.clock.stage(stage.name):
                    stage.prepare(job)
        with job.clock.stage(CONVERT):
            job.report = convert_model(job.source.model, job.plan, calibration=job.calibration,
                                       source=job.model_name, hooks=module_hooks(job))
        job.each("finish")


def module_hooks(job: Conversion) -> ModuleHooks:
    """The module loop's hooks: progress always; where the source streams, every stage's module steps."""
    def progress(name: str, index: int, total: int) -> None:
        job.progress(f"converting {name}", index, total)

    if not job.source.streaming:
        return ModuleHooks(progress)
    return ModuleHooks(progress, load=lambda name: job.each("before_module", name),
                       release=lambda name: job.each("after_module", name))
