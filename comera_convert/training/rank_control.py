"""CoMERA's rank control: model size from the gates, its surrogate, pruning, and the two stages.

Size S (CoMERA Eq. 4): per TT layer, the sum over cores of n_k * r_{k-1} * r_k, where r counts
the open (nonzero) entries of each bond's gate. Its differentiable surrogate R is the mean of
|g| over the open entries (an l1 relaxation). Early stage: minimize L + beta * R. Late stage:
drive towards a target (L0, S0) along the subgradient of max{(L - L0)/L, (S - S0)/S}: the
size term when size is the worse-off objective, the task loss otherwise, plus a small
weighted-sum term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError
from ..layers import TTModule

EARLY, LATE = "early", "late"


def gated_modules(model: nn.Module) -> list[tuple[str, TTModule]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TTModule) and m.gates is not None]


def module_size(module: TTModule) -> int:
    """Stored entries of the module's cores at its open ranks (what truncation would keep)."""
    open_ranks = (1,) + module.ranks + (1,)
    physical = [math.prod(shape[1:-1]) for shape in module.spec.core_shapes()]
    return sum(n * open_ranks[k] * open_ranks[k + 1] for k, n in enumerate(physical))


def whole_multiples(closing: torch.Tensor, is_open: torch.Tensor, gate: torch.Tensor,
                    multiple: int) -> torch.Tensor:
    """The weakest of the ``closing`` entries, as many as leave the bond's open count a multiple of
    ``multiple`` (rounded up: fewer close, none when the rest would not reach a lower multiple).
    Counts stay tensors: no host sync."""
    open_count, candidates = is_open.sum(), closing.sum()
    keep = torch.minimum(open_count, (open_count - candidates + multiple - 1) // multiple * multiple)
    weakest_first = torch.where(closing, gate.abs(), torch.full_like(gate, math.inf)).argsort()
    order = torch.arange(len(gate), device=gate.device)
    position = torch.empty_like(weakest_first).scatter_(0, weakest_first, order)
    return closing & (position < open_count - keep)


@dataclass
class RankState:
    """What the controller must carry across a checkpoint."""

    stage: str = EARLY
    switch_step: int | None = None
    size_at_switch: int | None = None
    target_size: int | None = None
    target_loss: float | None = None
    loss_ema: float | None = None
    ema_history: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class RankController:
    """Gates of every TT module of a model: size, surrogate, pruning and the staged objective."""

    def __init__(self, model: nn.Module, options, dense_params: int):
        self.modules = gated_modules(model)
        if not self.modules:
            raise ConfigError("the model has no rank gates, so CoMERA's rank adaptation cannot run: "
                              "convert it with gates (leave out --no-gates)")
        self.model = model
        self.options = options
        self.dense_params = dense_params
        self.state = RankState()
        # Open entries per gate. Closed is for good: an optimizer step's momentum must not reopen
        # an entry. A gate that starts at zero (a resumed, expanded checkpoint) starts closed.
        self.sync_open()

    def sync_open(self) -> None:
        """Take the open entries from the gates as they are (after loading a checkpoint)."""
        self.open = [[(g.detach() != 0) for g in m.gates] for _, m in self.modules]

    # -- measurements -------------------------------------------------------------------------------
    def size(self) -> int:
        """S: entries the TT cores keep at the open ranks."""
        return sum(module_size(m) for _, m in self.modules)

    def model_params(self) -> int:
        """The whole model's parameter count once closed ranks are truncated away."""
        total = sum(p.numel() for p in self.model.parameters())
        for _, module in self.modules:
            stored = sum(c.numel() for c in module.cores) + sum(g.numel() for g in module.gates)
            total += module_size(module) + sum(module.ranks) - stored
        return total

    def ratio(self) -> float:
        return self.dense_params / max(self.model_params(), 1)

    def ranks(self) -> dict[str, tuple[int, ...]]:
        return {name: module.ranks for name, module in self.modules}

    def surrogate(self) -> torch.Tensor:
        """R: mean |g| over open gate entries (differentiable)."""
        gates = torch.cat([g.abs().reshape(-1) for _, m in self.modules for g in m.gates])
        open_entries = (gates.detach() > 0).sum().clamp_min(1)
        return gates.sum() / open_entries

    # -- pruning --------------------------------------------------------------------------------------
    @torch.no_grad()
    def prune(self) -> int:
        """Close gate entries below tau for good (gate and core slices zeroed); returns how many closed.

        Runs after every optimizer step; it also puts back to zero the closed entries that the
        step moved (AdamW's momentum keeps moving them), so closed stays closed.
        """
        closed = 0
        for (_, module), masks in zip(self.modules, self.open):
            for i, gate in enumerate(module.gates):
                mask = masks[i] = masks[i].to(gate.device)  # the model may have moved (Trainer, .cuda())
                newly = mask & (gate.abs() < self.options.tau)
                # Never close a bond's last open entry: spare the strongest when nothing else stays
                # open (computed on the device: no host sync per gate).
                strongest = torch.zeros_like(mask).scatter_(0, (gate.abs() * mask).argmax().reshape(1), True)
                newly &= ~(strongest & ~(mask & ~newly).any())
                if self.options.rank_multiple > 1:
                    newly = whole_multiples(newly, mask, gate, self.options.rank_multiple)
                mask &= ~newly
                closed = closed + newly.sum()
                gate.mul_(mask)
            module.zero_pruned_()
        return int(closed)  # the one host sync of the step

    # -- the staged objective -----------------------------------------------------------------------
    def observe_loss(self, loss: float) -> None:
        decay = 0.9
        ema = self.state.loss_ema
        self.state.loss_ema = loss if ema is None else decay * ema + (1 - decay) * loss
        window = self.options.plateau_window
        if window:
            self.state.ema_history = (self.state.ema_history + [self.state.loss_ema])[-(window + 1):]

    def should_switch(self, step: int) -> bool:
        if self.state.stage != EARLY:
            return False
        if step >= self.options.early_steps:
            return True
        history, window = self.state.ema_history, self.options.plateau_window
        if window and len(history) > window:
            gain = (history[0] - history[-1]) / max(abs(history[0]), 1e-12)
            return gain < self.options.plateau_tol
        return False

    def switch(self, step: int) -> None:
        """Enter the late stage: fix the target point (L0, S0)."""
        size = self.size()
        self.state.stage, self.state.switch_step, self.state.size_at_switch = LATE, step, size
        if self.options.target_ratio is not None:
            # The whole model must hold dense_params / target_ratio: the TT part gets what the rest leaves.
            rest = self.model_params() - size - sum(sum(m.ranks) for _, m in self.modules)
            self.state.target_size = max(1, int(self.dense_params / self.options.target_ratio) - rest)
        else:
            self.state.target_size = max(1, int(size * self.options.target_fraction))
        self.state.target_loss = (self.options.target_loss if self.options.target_loss is not None
                                  else self.state.loss_ema)

    def objective(self, task_loss: torch.Tensor) -> torch.Tensor:
        """The loss to minimize this step, by stage."""
        beta = self.options.beta
        surrogate = self.surrogate()
        if self.state.stage == EARLY:
            return task_loss + beta * surrogate
        loss_value = float(task_loss.detach())
        size = self.size()
        loss_gap = (loss_value - self.state.target_loss) / max(abs(loss_value), 1e-12)
        size_gap = (size - self.state.target_size) / max(size, 1)
        worse = self.options.late_rank_weight * surrogate if size_gap > loss_gap else task_loss
        return worse + self.options.late_weighted_sum * (task_loss + beta * surrogate)
