"""Error-compensating calibration, block by block: each linear layer is fit to the inputs the
already compressed layers before it produce, so that errors do not compound down the stack (as
GPTQ and SVD-LLM v2 calibrate).

Two streams of the calibration batches go through the blocks side by side: the dense model's
hidden states and the compressed model's. When the converter reaches a block, a dense copy of it
is kept; before each of its linear layers (each group reading one input: q, k and v) is
decomposed, both streams are run through the block as far as that layer: the dense copy gives its
dense inputs X, the block itself (its earlier layers compressed by now) the inputs X^ it will
really see. The statistics then hold G = X^T X^, X^T X and both means: the layer is decomposed
from M* = G^-1 X^T X M whitened by G, which minimizes ||X^ M_tt - X M|| (``compensated_matrix``),
and its bias matches the dense mean output. Once the block is converted, both streams move past
it (the dense copy, the compressed block) and its layers are written out.

It keeps more of the dense model's retrieval than fitting each layer to the dense inputs, in and out
of the calibration's domain, and with block reconstruction also where the factorized layers are cut
least, so it is on by default wherever the ratio cuts them at all (docs/findings.md;
``conversion/plan.py``, ``conversion/regime.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from ..conversion.calibration import add_gram
from .sequential import BlockInputs, SequentialCalibration, StopForward, capture_into, hidden_of

# G is damped by this share of its mean diagonal before M* is solved for and whitened by: the
# least-squares map is otherwise steered by directions the calibration inputs barely excite (1e-2
# kept the most on MiniLM of 1e-3, 1e-2 and 5e-2).
COMPENSATION_RIDGE = 1e-2
# The map M* has as many unknowns per output as the layer has inputs, so it overfits calibration
# text that gives too few input rows: a layer with fewer rows than this per input is fit to the dense
# inputs instead. docs/findings.md
MIN_ROWS_PER_INPUT = 8


@dataclass
class ClosingBlock:
    """A block whose layers are all converted, as the compressed stream is about to move past it: the block
    itself, the compressed stream's inputs to it and the dense block's hidden states (what it should give)."""

    index: int
    module: nn.Module
    inputs: list[BlockInputs]
    targets: list[torch.Tensor]


class CompensatingCalibration(SequentialCalibration):
    """A ``SequentialCalibration`` whose statistics compensate the compression error of the layers
    before each one (module docstring). Modules outside the stack (embeddings, pooler, head) keep
    the dense statistics.

    ``fit_to_compressed`` False fits each layer to the dense inputs instead (the streams still run,
    for reconstruction); ``on_block`` hears of each block once its layers are converted, before the
    compressed stream moves past it (``ClosingBlock``: the stages' ``per_block``, where reconstruction
    tunes it)."""

    def __init__(self, *args, fit_to_compressed: bool = True,
                 on_block: Callable[[ClosingBlock], None] = lambda block: None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fit_to_compressed, self.on_block = fit_to_compressed, on_block
        self.compressed_inputs: list[BlockInputs] | None = None  # the compressed stream, at the open block
        self.open: int | None = None  # the block whose layers are being converted
        self.dense_block: nn.Module | None = None  # a dense copy of it
        self.shared: dict[str, list[str]] = {}  # its candidates, each with those reading the same input
        self.converted: list[str] = []  # its converted layers, written out when it closes

    def passes(self, name: str) -> None:
        index = self.block_of(name)
        if index is None:
            if self.open is not None and not self.finished:
                self._close()  # a module after the stack: the blocks are done
            return super().passes(name)
        if not self.inputs and not self.finished:
            self.start()
        if self.compressed_inputs is None:  # the modules before the stack are converted by now
            self.compressed_inputs = self._stack_inputs()
        while self.open != index:
            if self.open is not None:
                self._close()
            self._open(self.done_blocks)
        if name not in self.stats.grams:
            self._record_pair(name)

    def release(self, name: str) -> None:
        if self.block_of(name) is None:
            return super().release(name)
        self.stats.forget(name)
        self.converted.append(name)  # the compressed stream still runs through it

    def finish(self) -> None:
        if self.open is not None:
            self._close()
        super().finish()

    # The passes ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _stack_inputs(self) -> list[BlockInputs]:
        """Every batch run up to the first block through the model as it is now (compressed)."""
        captured: list[BlockInputs] = []
        handle = self.stack[0].register_forward_pre_hook(partial(capture_into, captured), with_kwargs=True)
        try:
            for batch in self.plan.batches:
                self._forward(batch)
        finally:
            handle.remove()
        return captured

    def _open(self, index: int) -> None:
        """Read block ``index``, keep a dense copy of it, and find which of its candidates share an input."""
        self.open = index
        self.dense_block = copy.deepcopy(self._load_block(index)).eval()
        self.shared = self._shared_inputs(index)

    @torch.no_grad()
    def _shared_inputs(self, index: int) -> dict[str, list[str]]:
        """Each candidate of block ``index`` -> the candidates reading the very same input tensor."""
        seen: dict[str, torch.Tensor] = {}

        def remember(name, module, args):
            seen.setdefault(name, args[0])

        handles = [self._relative(self.dense_block, c.name).register_forward_pre_hook(partial(remember, c.name))
                   for c in self.by_block[index]]
        try:
            self.dense_block(*self.inputs[0].args, **self.inputs[0].kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return {name: [other for other, x in seen.items() if x is tensor] for name, tensor in seen.items()}

    @torch.no_grad()
    def _record_pair(self, name: str) -> None:
        """Fill the statistics of ``name`` (and of the layers sharing its input) from both streams."""
        dense_layer = self._relative(self.dense_block, name)
        layer = self.model.get_submodule(name)
        block = self.stack[self.open]
        block.eval()
        gram = cross = sums = dense_sums = None
        rows = 0
        for dense_inputs, inputs in zip(self.inputs, self.compressed_inputs):
            x = _input_of(dense_layer, self.dense_block, dense_inputs)
            if gram is None:
                width = x.shape[1]
                compensating = self.fit_to_compressed and self.stats.tokens >= MIN_ROWS_PER_INPUT * width
                gram, sums = torch.zeros(width, width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
                if compensating:
                    cross, dense_sums = torch.zeros_like(gram), torch.zeros_like(sums)
            x_hat = _input_of(layer, block, inputs) if compensating else x
            add_gram(gram, x_hat)
            sums.add_(x_hat.sum(0).double().cpu())
            rows += x.shape[0]
            if compensating:
                cross.add_((x_hat.T @ x).cpu())
                dense_sums.add_(x.sum(0).double().cpu())
        if compensating:
            gram.diagonal().add_(COMPENSATION_RIDGE * float(gram.diagonal().mean()))
        for member in self.shared.get(name, [name]):
            self.stats.grams[member], self.stats.sums[member], self.stats.rows[member] = gram, sums, rows
            if compensating:
                self.stats.cross[member], self.stats.dense_sums[member] = cross, dense_sums

    @torch.no_grad()
    def _close(self) -> None:
        """Move both streams past the open block and write its converted layers out."""
        block = self.stack[self.open]
        block.eval()
        self.last_outputs = [inputs.run(self.dense_block) for inputs in self.inputs]
        self.on_block(ClosingBlock(self.open, block, self.compressed_inputs,
                                   [hidden_of(output) for output in self.last_outputs]))
        for inputs in self.compressed_inputs:
            inputs.run(block)
        for name in self.converted:
            self.streamed.spill(self.model, name)
        self.converted, self.shared, self.dense_block = [], {}, None
        self.done_blocks, self.open = self.open + 1, None

    def _relative(self, block: nn.Module, name: str) -> nn.Module:
        """The module of ``block`` (a copy of the open block) at the place of the model's ``name``."""
        return block.get_submodule(name[len(f"{self.blocks}.{self.open}."):])


def _input_of(layer: nn.Module, block: nn.Module, inputs: BlockInputs) -> torch.Tensor:
    """The rows ``layer`` receives when ``block`` runs on ``inputs`` (float32), the pass stopped there."""
    got = []

    def capture(module, args):
        got.append(args[0].reshape(-1, args[0].shape[-1]).float())
        raise StopForward

    handle = layer.register_forward_pre_hook(capture)
    try:
        block(*inputs.args, **inputs.kwargs)
    except StopForward:
        pass
    finally:
        handle.remove()
    return got[0]
