"""Calibration block by block, for a streamed conversion: the dense model is never whole in memory.

Sequential calibration pipelines work the same way: the calibration batches are run up to the
first repeated block (decoder or encoder layer) once, and the inputs each batch gives that block
are kept (hidden states, and the attention mask and position embeddings it is called with). Then,
one block at a time, just before the converter needs its statistics: the block's weights are read,
its inputs run through it while forward hooks record its linear layers' Gram matrices, its outputs
become the next block's inputs, and the converter decomposes it and writes it out. After the last
block, its outputs are replayed in its place so that what follows (final norm, output head) is
calibrated too. The statistics equal those of a whole-model calibration: every block sees the
dense model's activations.

Only one block's dense weights and one block's Gram matrices are held at a time, with the modules
outside the blocks (embeddings, final norm, head) and the hidden states of the calibration batches.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
from torch import nn

from ..conversion.calibration import CalibrationPlan, Recorder, empty_statistics
from ..conversion.targets import Candidate
from ..layers.swap import set_submodule
from .spool import to_meta
from .streaming import Streamed, load_module, load_the_rest


class StopForward(Exception):
    """Raised by a hook once the forward pass has gone as far as it needs to."""


def hidden_of(output):
    """A block's hidden states: the first element of a tuple output, or the output itself."""
    return output[0] if isinstance(output, tuple) else output


class BlockInputs:
    """What one calibration batch passes the next block: positional and keyword arguments."""

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs

    def run(self, block: nn.Module):
        """Run ``block`` on these inputs; its output's hidden states become the inputs of the next."""
        output = block(*self.args, **self.kwargs)
        hidden = hidden_of(output)
        if self.args:
            self.args = (hidden, *self.args[1:])
        else:
            self.kwargs = {**self.kwargs, "hidden_states": hidden}
        return output


def capture_into(store: list, module, args, kwargs):
    """A forward pre-hook (with kwargs) on the first block: keep what the batch passes it, stop there."""
    store.append(BlockInputs(args, dict(kwargs)))
    raise StopForward


class Replay(nn.Module):
    """Stands in for the whole stack of blocks: returns the last block's outputs, batch by batch."""

    def __init__(self, outputs: list):
        super().__init__()
        self.outputs = outputs

    def forward(self, *args, **kwargs):
        return self.outputs.pop(0)


class SequentialCalibration:
    """Fills a calibration's statistics block by block as the converter reaches each block.

    ``passes(name)``, just before the converter decomposes module ``name`` (its weights read by then), runs
    every block up to the one holding it (or, for a module after the blocks, all of them and what follows).
    ``release(name)`` drops its statistics and writes it out; modules outside the blocks are written out only
    at the end (the last pass runs them)."""

    def __init__(self, model: nn.Module, streamed: Streamed, plan: CalibrationPlan, candidates: list[Candidate],
                 blocks: str, source: str):
        self.model, self.streamed, self.plan, self.blocks = model, streamed, plan, blocks
        self.stats = empty_statistics(plan.batches, source, plan.needed)
        self.stack = model.get_submodule(blocks)
        self.by_block: list[list[Candidate]] = [[] for _ in self.stack]
        self.outside: list[Candidate] = []
        for candidate in candidates:
            index = self.block_of(candidate.name)
            (self.outside if index is None else self.by_block[index]).append(candidate)
        self.inputs: list[BlockInputs] = []
        self.done_blocks = 0
        self.last_outputs: list = []  # the last block run's outputs, replayed for the modules after the stack
        self.finished = False
        self.deferred: list[str] = []

    def block_of(self, name: str) -> int | None:
        prefix = f"{self.blocks}."
        if not name.startswith(prefix):
            return None
        return int(name[len(prefix):].split(".", 1)[0])

    # The passes ------------------------------------------------------------------------------------
    @torch.no_grad()
    def start(self) -> None:
        """Read the weights outside the blocks, run the batches up to the first block (recording what
        runs before it), and let go of what did not run (final norm, head: read again later)."""
        self._load_outside()
        ran: set[str] = set()
        outside = [(n, m) for n, m in self.model.named_modules()
                   if self.block_of(n) is None and n != self.blocks
                   and next(m.parameters(recurse=False), None) is not None]
        handles = [m.register_forward_pre_hook(lambda module, args, name=n: ran.add(name)) for n, m in outside]
        handles.append(self.stack[0].register_forward_pre_hook(partial(capture_into, self.inputs), with_kwargs=True))
        self._recorded_pass(self.outside, handles)
        for name, module in outside:
            if name not in ran:  # after the blocks (final norm, head): read again when needed
                to_meta(module)
        self.plan.count_tokens(self.stats)

    def _load_outside(self) -> None:
        load_the_rest(self.model, self.streamed.source, skip=lambda name: self.block_of(name) is not None)

    @torch.no_grad()
    def _run_block(self, index: int) -> None:
        """Read block ``index``, record its candidates' inputs, move the hidden states past it."""
        for done in self.by_block[:index]:
            for candidate in done:  # what the converter left dense (too small to compress) is never released
                self.stats.forget(candidate.name)
        block = self._load_block(index)
        outputs = []
        with Recorder(self.stats, self.by_block[index]) as recorder:
            for inputs in self.inputs:
                recorder.next_batch()
                outputs.append(inputs.run(block))
        self.done_blocks = index + 1
        self.last_outputs = outputs

    def _load_block(self, index: int) -> nn.Module:
        """Block ``index`` with its weights read (load_module reads only what is still on the meta device)."""
        prefix = f"{self.blocks}.{index}"
        for name, _ in self.stack[index].named_modules():
            load_module(self.model, f"{prefix}.{name}" if name else prefix, self.streamed.source)
        return self.stack[index]

    @torch.no_grad()
    def _finish_blocks(self) -> None:
        """Run the blocks left, then the batches once more with the stack replayed, recording the
        modules after it (final norm's consumers: the output head)."""
        while self.done_blocks < len(self.stack):
            self._run_block(self.done_blocks)
        self.finished = True
        waiting = [c for c in self.outside if c.kind == "linear" and c.name not in self.stats.grams]
        if not waiting or not self.last_outputs:
            return
        self._load_outside()
        stack = self.stack
        set_submodule(self.model, self.blocks, nn.ModuleList([Replay(self.last_outputs)]))
        try:
            stops = [m.register_forward_pre_hook(self._stop_at_meta) for m in self.model.modules()
                     if not isinstance(m, (nn.ModuleList, Replay))]
            self._recorded_pass(waiting, stops)
        finally:
            set_submodule(self.model, self.blocks, stack)

    def _recorded_pass(self, candidates: list[Candidate], hooks: list) -> None:
        """Every calibration batch through the model, ``candidates``' inputs recorded; ``hooks``
        (which stop the pass where it has gone far enough) removed after."""
        try:
            with Recorder(self.stats, candidates) as recorder:
                for batch in self.plan.batches:
                    recorder.next_batch()
                    self._forward(batch)
        finally:
            for hook in hooks:
                hook.remove()

    @classmethod
    def _stop_at_meta(cls, module, args):
        # A module whose weights were written out already (a tied head of a converted embedding)
        # comes after everything the pass records: stop there.
        if cls._has_meta(module):
            raise StopForward

    def _forward(self, batch: torch.Tensor) -> None:
        kwargs = {"input_ids": batch}
        if "use_cache" in inspect.signature(self.model.forward).parameters:
            kwargs["use_cache"] = False  # no key/value cache: the blocks are run again by hand
        try:
            self.model(**kwargs)
        except StopForward:
            pass

    @staticmethod
    def _has_meta(module: nn.Module) -> bool:
        return any(p.is_meta for p in module.parameters(recurse=False))

    # The converter's hooks -------------------------------------------------------------------------
    def passes(self, name: str) -> None:
        if not self.inputs and not self.finished:
            self.start()
        index = self.block_of(name)
        if index is not None:
            while self.done_blocks <= index:
                self._run_block(self.done_blocks)
        elif not self.finished and name not in self.stats.counts and name not in self.stats.grams:
            self._finish_blocks()

    def release(self, name: str) -> None:
        self.stats.forget(name)
        if self.block_of(name) is None:
            self.deferred.append(name)  # the passes after the blocks may still run it
            return
        self.streamed.spill(self.model, name)

    def finish(self) -> None:
        for name in self.deferred:
            self.streamed.spill(self.model, name)
        self.inputs.clear()
