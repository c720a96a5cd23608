"""Block-wise reconstruction: after the closed-form fit, a compressed block's parameters are tuned
for a bounded number of Adam steps to reproduce the dense block's outputs.

As BRECQ and OmniQuant calibrate quantized blocks, and SVD-LLM's parameter update does for low
rank: the block's inputs are those the already compressed blocks before it give (the compressed
stream of ``compensating.py``), its targets the dense block's outputs on the dense inputs, so each
block also makes up for the error of the blocks before it. The loss is the cosine distance of
each token's hidden state from the dense one (``token_distance``). What is tuned: the block's factors,
biases and norms (not the rank gates, which would only rescale the factors). The last calibration
batch is held out: the block keeps the tuned parameters only where they lower the error there,
and falls back to the closed-form fit, with a one-line warning, where they do not or where a step
is not finite (so no NaN is ever saved).

With integer storage (``grid``: ``--dtype int8|int4``) the block is tuned on its factors rounded to
that grid (quantization-aware, as OmniQuant and BRECQ tune rounded blocks: the forward passes run
on ``fake_quantize``'s values), then its factors are rounded there in place: what the blocks after
it are fit to and what the checkpoint writes are the values the tuning saw. Tuned in float and
rounded only as written, the tuning's gain is partly lost to the rounding (docs/findings.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..conversion.distance import token_distance
from ..conversion.storage import round_in_place, train_on_the_grid
from ..integer import IntegerFormat
from .sequential import hidden_of

logger = logging.getLogger("comera_convert")

# Sequences a step trains on: 8 of 128 tokens, small enough that 100 steps of a MiniLM block take
# about 4 s on 2 CPU cores.
STEP_SEQUENCES = 8
# A block whose tuning does not lower its held-out distance is tuned once more at this share of the
# rate: most of all-mpnet-base-v2's blocks reject 1e-3 at --ratio 2, while a lower rate everywhere
# keeps less on MiniLM. docs/findings.md
# The blocks after one that kept the lower rate try it first (``rates_to_try``).
RETRY_LR_SHARE = 0.3


@dataclass
class BlockFit:
    """What reconstruction did to one block: the distance of its outputs from the dense block's on the
    held-out batch (``token_distance``) before and after, and whether the tuned parameters were kept."""

    block: int
    error_before: float
    error_after: float
    kept: bool
    steps: int
    lr: float
    # The held-out distance the tuned parameters reached, kept or not (inf: a step was not finite).
    tried: float = math.nan

    def to_dict(self) -> dict:
        return {"block": self.block, "error_before": round(self.error_before, 5),
                "error_after": round(self.error_after, 5), "kept": self.kept, "steps": self.steps, "lr": self.lr}


def tunable(block: nn.Module) -> list[nn.Parameter]:
    """The block's float parameters but its rank gates."""
    return [p for name, p in block.named_parameters() if p.is_floating_point() and "gates" not in name.split(".")]


def forget_caches(block: nn.Module) -> None:
    """Drop what the block's TT layers built for inference: the optimizer wrote their factors."""
    for module in block.modules():
        if hasattr(module, "clear_cache"):
            module.clear_cache()


def held_out_distance(block: nn.Module, inputs, targets) -> float:
    """``token_distance`` of the block's outputs on ``inputs`` from ``targets``, over all their tokens."""
    forget_caches(block)
    total = tokens = 0.0
    with torch.no_grad():
        for batch, target in zip(inputs, targets):
            output = hidden_of(block(*batch.args, **batch.kwargs))
            count = target.numel() // target.shape[-1]
            total += float(token_distance(output, target)) * count
            tokens += count
    return total / tokens if tokens else 0.0


def _rows(batch, start: int, stop: int):
    """Sequences start..stop of a block's inputs (every argument batched along its first axis)."""
    size = (batch.args[0] if batch.args else batch.kwargs["hidden_states"]).shape[0]

    def cut(value):
        return value[start:stop] if torch.is_tensor(value) and value.dim() and value.shape[0] == size else value

    return tuple(cut(a) for a in batch.args), {k: cut(v) for k, v in batch.kwargs.items()}


def rates_to_try(lr: float, earlier: Sequence[BlockFit]) -> tuple[float, float]:
    """The two rates a block is tuned at, in order: first the one the last block that kept its tuning
    kept (``lr`` at the start), then the other of ``lr`` and RETRY_LR_SHARE of it. The blocks of one
    model take alike to a rate: at all-mpnet-base-v2 --ratio 2 eleven of twelve rejected 1e-3 and the
    retry at the lower rate cost a fifth of the conversion."""
    lower = lr * RETRY_LR_SHARE
    last = next((fit.lr for fit in reversed(earlier) if fit.kept), lr)
    return (lower, lr) if math.isclose(last, lower) else (lr, lower)


def reconstruct_block(block: nn.Module, index: int, inputs, targets, steps: int, lr: float,
                      seed: int = 0, grid: IntegerFormat | None = None,
                      earlier: Sequence[BlockFit] = ()) -> BlockFit:
    """Tune ``block`` (in place) for ``steps`` Adam steps so that it maps ``inputs`` (BlockInputs of
    the compressed stream) onto ``targets`` (the dense block's hidden states), the last batch held
    out; keep the result only where it lowers the held-out error, else tune once more at the other
    rate (``rates_to_try``, given the ``earlier`` blocks' fits); with ``grid``, on its factors rounded
    to it (module docstring)."""
    rates = rates_to_try(lr, earlier)
    if grid is None:
        return _tuned_or_retried(block, index, inputs, targets, steps, rates, seed)
    train_on_the_grid(block, grid)
    try:
        return _tuned_or_retried(block, index, inputs, targets, steps, rates, seed)
    finally:
        # fake_quantize's grid: each group's scale by its largest magnitude. Factors the conversion
        # rounded already (by the clip search) sit on it, so an untuned block keeps them.
        snapped = replace(grid, clip_search=False)
        for layer in [m for m in block.modules() if getattr(m, "integer_format", None) is not None]:
            round_in_place(layer, snapped)
        train_on_the_grid(block, None)
        forget_caches(block)


def _tuned_or_retried(block: nn.Module, index: int, inputs, targets, steps: int, rates: tuple[float, float],
                      seed: int) -> BlockFit:
    """``_tuned`` at the first of ``rates``, and where that is rejected once more at the second (from
    the same parameters: a rejected try puts them back); a warning where both are rejected."""
    before = held_out_distance(block, inputs[-1:], targets[-1:])
    fit = _tuned(block, index, inputs, targets, steps, rates[0], seed, before)
    if fit.kept:
        return fit
    retried = _tuned(block, index, inputs, targets, steps, rates[1], seed, before)
    if not retried.kept:
        logger.warning("block %d: reconstruction %s at %g and %g; kept the closed-form fit", index,
                       _failure(fit), fit.lr, retried.lr)
    return retried


def _failure(fit: BlockFit) -> str:
    """Why a try was rejected, for the warning: it diverged, or the distance it reached."""
    if not math.isfinite(fit.tried):
        return "diverged (a step was not finite)"
    return f"did not lower the held-out distance to the dense outputs ({fit.error_before:.4f} -> {fit.tried:.4f})"


def _tuned(block: nn.Module, index: int, inputs, targets, steps: int, lr: float, seed: int,
           before: float) -> BlockFit:
    """The steps themselves, on whatever the block's layers run (``reconstruct_block``), from the
    held-out distance ``before`` they start at."""
    train_inputs, train_targets = inputs[:-1], targets[:-1]
    params = tunable(block)
    saved = [p.detach().clone() for p in params]
    pieces = [(batch, target, start, min(start + STEP_SEQUENCES, target.shape[0]))
              for batch, target in zip(train_inputs, train_targets)
              for start in range(0, target.shape[0], STEP_SEQUENCES)]
    draw = torch.Generator().manual_seed(seed)
    flags = {id(p): p.requires_grad for p in block.parameters()}
    for p in block.parameters():
        p.requires_grad_(id(p) in {id(q) for q in params})
    optimizer = torch.optim.Adam(params, lr=lr)
    # A cosine decay to zero: the last steps settle instead of jumping around the minimum.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    finite = True
    try:
        with torch.enable_grad():
            for _ in range(steps):
                batch, target, start, stop = pieces[int(torch.randint(len(pieces), (1,), generator=draw))]
                args, kwargs = _rows(batch, start, stop)
                loss = token_distance(hidden_of(block(*args, **kwargs)), target[start:stop])
                if not torch.isfinite(loss):
                    finite = False
                    break
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
    finally:
        for p in block.parameters():
            p.requires_grad_(flags[id(p)])
    after = held_out_distance(block, inputs[-1:], targets[-1:]) if finite else math.inf
    kept = finite and math.isfinite(after) and after < before
    if not kept:
        with torch.no_grad():
            for param, value in zip(params, saved):
                param.copy_(value)
    return BlockFit(index, before, after if kept else before, kept, steps, lr, tried=after)
