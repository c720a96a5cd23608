"""Learned rank allocation: how the ``--ratio`` budget is split between layers, learned end to end on
calibration text (as Dobi-SVD learns truncation positions).

For the length of the learning, each linear layer learned runs as its whitened SVD, the basis the
conversion's decomposition keeps directions of (S W^T = U diag(sigma) V^T with S^T S the Gram of
the layer's dense inputs), behind a soft truncation mask sigmoid((k - i - 1/2) / width) over its
directions i: k is the layer's rank, a real number the loss can move. The ranks share an exact
budget, what the uniform allocation spends on these layers: k_l = c base_l exp(theta_l) with c
chosen so that sum_l k_l (rows_l + cols_l) equals it, so a step can only move rank from one layer
to another. Adam on theta against the token distance of the model's last hidden states from the
dense model's (block reconstruction's loss: ``distance.token_distance``); the model's own weights
stay frozen. The learned ranks over the uniform shared rank are per-layer scales, which
``allocate_ranks`` takes as it takes the uniform allocation's: it then finds the shared rank that
meets the ratio exactly, and the conversion (compensation, reconstruction) runs as it does for the
uniform allocation. Which layers are learned is the strategy's choice (``strategies.learn_allocation``:
every block's but the last).

At --ratio 4 rank moves from the middle blocks' query and key projections to the first blocks'
feed-forward layers, and the converted model keeps more cosine to the dense embeddings on every
held-out domain (docs/findings.md).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.swap import set_submodule
from ..layers.tt_linear import dense_weight_of
from ..tt.weighted import input_factor
from .calibration import collect
from .distance import token_distance
from .targets import Candidate

# Adam steps, each on STEP_SEQUENCES sequences and a forward and backward pass of the model: what
# LEARNING_STEP_BUDGET parameter-steps buy (MiniLM settles in 20-40; all-mpnet-base-v2 gets 40),
# LEARNING_STEPS at most. docs/findings.md
LEARNING_STEPS = 100
LEARNING_STEP_BUDGET = 40 * 110_000_000
MIN_LEARNING_STEPS = 10
LEARNING_RATE = 0.05
STEP_SEQUENCES = 8
# Calibration sequences a conversion learns on (the last batch of STEP_SEQUENCES held out): the
# default calibration's size; its Gram matrices have full rank for inputs up to 16 384 wide.
LEARNING_SEQUENCES = 128
# The soft mask's width in directions: a few ranks either side of k feel the gradient, so a layer's
# rank moves by the value of the directions at its edge. A share of the shared rank (0.04), at least 2.
MASK_WIDTH_SHARE = 0.04
MIN_MASK_WIDTH = 2.0
# The Gram is damped by this share of its mean diagonal before whitening, as compensation damps
# its own (pipeline/compensating.COMPENSATION_RIDGE): directions the text barely excites do not
# steer the basis.
RIDGE = 1e-2


@dataclass
class LearnedRanks:
    """What the learning found: each layer's rank over the shared rank (``scales``), and the token
    distance of the model's outputs from the dense ones on a held-out batch, at the uniform split
    (``distance_before``) and at the learned one, both with every layer at its whitened SVD."""

    scales: dict[str, float]
    distance_before: float
    distance_after: float
    steps: int
    seconds: float

    def to_dict(self) -> dict:
        return {"rank_scales": dict(self.scales),
                "learned_distance": [round(self.distance_before, 5), round(self.distance_after, 5)],
                "learning_steps": self.steps, "learning_seconds": round(self.seconds, 1)}


class SoftTruncated(nn.Module):
    """A linear layer as its whitened SVD (up to ``cap`` directions), each direction's output scaled
    by ``mask`` (set before each forward): y = ((x A) * mask) B + bias."""

    def __init__(self, layer: nn.Module, gram: torch.Tensor, cap: int):
        super().__init__()
        weight, bias = dense_weight_of(layer)
        weight = weight.detach().to(torch.float64)
        eye = torch.eye(gram.shape[0], dtype=torch.float64)
        factor, _ = input_factor(gram + RIDGE * float(gram.diagonal().mean()) * eye)
        u, sigma, vh = torch.linalg.svd(factor @ weight.T, full_matrices=False)
        left = torch.linalg.solve_triangular(factor, u[:, :cap], upper=True) * sigma[:cap]
        dtype = layer.weight.dtype
        self.register_buffer("left", left.to(dtype))
        self.register_buffer("right", vh[:cap].to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ((x @ self.left) * self.mask.to(x.dtype)) @ self.right
        return y if self.bias is None else y + self.bias


def breakeven_rank(candidate: Candidate) -> int:
    """The rank at which a low-rank pair stores as much as the dense matrix: the most worth learning."""
    rows, cols = candidate.rows, candidate.cols
    return max(1, min(rows, cols, rows * cols // (rows + cols)))


def last_hidden(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The model's last hidden states for ``batch`` (under any head)."""
    return model(input_ids=batch, output_hidden_states=True).hidden_states[-1]


def learn_rank_scales(model: nn.Module, layers: list[Candidate], base: dict[str, float], shared_rank: int,
                      batches: list[torch.Tensor], steps: int = LEARNING_STEPS, lr: float = LEARNING_RATE
                      ) -> LearnedRanks:
    """Per-layer rank scales for ``layers`` (linears of ``model``, dense), learned from the uniform
    split (``base[name]`` times ``shared_rank``) on ``batches`` of token ids, the last held out
    (module docstring). ``model`` is restored before returning."""
    began = time.perf_counter()
    if len(batches) < 2:
        raise ValueError("learning a rank allocation needs at least two batches: one is held out")
    model.eval()
    grams = collect(model, layers, batches).grams  # q, k and v share one
    with torch.no_grad():
        targets = [last_hidden(model, batch) for batch in batches]
    caps = [breakeven_rank(c) for c in layers]
    soft = SoftRanks([SoftTruncated(c.module, grams.pop(c.name), cap) for c, cap in zip(layers, caps)], layers,
                     torch.tensor([base[c.name] for c in layers], dtype=torch.float64), shared_rank, caps)

    def distance(index: int) -> torch.Tensor:
        soft.apply(soft.ranks())
        return token_distance(last_hidden(model, batches[index]), targets[index])

    with _swapped_in(model, layers, soft.modules):
        with torch.no_grad():
            before = float(distance(-1))
        optimizer = torch.optim.Adam([soft.theta], lr=lr)
        for step in range(steps):
            with torch.enable_grad():
                loss = distance(step % (len(batches) - 1))
                if not torch.isfinite(loss):
                    break
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            optimizer.step()
        with torch.no_grad():
            after = float(distance(-1))
        learned = soft.ranks().detach()
    if not math.isfinite(after) or after >= before:  # nothing learned: the uniform split stands
        learned, after = soft.uniform(), before
    # Rounded as the report records them, so that the scales a report gives back convert to the same ranks.
    scales = {c.name: round(float(k) / shared_rank, 3) for c, k in zip(layers, learned)}
    return LearnedRanks(scales, before, after, steps, time.perf_counter() - began)


class SoftRanks:
    """The learned ranks: the uniform split's shares times exp(theta), rescaled to spend the uniform split's
    parameters, capped at each layer's break-even rank, and applied as soft masks on the layers' directions."""

    def __init__(self, modules: list, layers: list[Candidate], shares: torch.Tensor, shared_rank: int, caps: list[int]):
        self.modules, self.shares, self.shared_rank = modules, shares, shared_rank
        self.cost = torch.tensor([float(c.rows + c.cols) for c in layers], dtype=torch.float64)
        self.ceiling = torch.tensor(caps, dtype=torch.float64)
        self.budget = float((self.uniform() * self.cost).sum())
        self.theta = torch.zeros(len(layers), dtype=torch.float64, requires_grad=True)
        self.width = max(MIN_MASK_WIDTH, MASK_WIDTH_SHARE * shared_rank)
        self.directions = [torch.arange(cap, dtype=torch.float64) + 0.5 for cap in caps]

    def uniform(self) -> torch.Tensor:
        """The uniform split's ranks, capped."""
        return torch.minimum(self.shares * self.shared_rank, self.ceiling)

    def ranks(self) -> torch.Tensor:
        weighted = self.shares * self.theta.exp()
        return (weighted * (self.budget / (weighted * self.cost).sum())).clamp(max=self.ceiling)

    def apply(self, rank: torch.Tensor) -> None:
        for module, index, k in zip(self.modules, self.directions, rank):
            module.mask = torch.sigmoid((k - index) / self.width)


@contextlib.contextmanager
def _swapped_in(model: nn.Module, layers: list[Candidate], modules: list):
    """``modules`` in place of ``layers`` with every parameter of ``model`` frozen; then all as it was."""
    frozen = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for candidate, module in zip(layers, modules):
        set_submodule(model, candidate.name, module)
    try:
        yield
    finally:
        for candidate in layers:
            set_submodule(model, candidate.name, candidate.module)
        for p in model.parameters():
            p.requires_grad_(frozen[id(p)])
