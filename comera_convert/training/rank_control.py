"""CoMERA's rank control: model size from the gates, its surrogate, pruning, and the two stages' objective
(when the stages run, and the budget's schedule, are ``stages.py``'s).

Size S (CoMERA Eq. 4): per TT layer, the sum over cores of n_k * r_{k-1} * r_k, where r counts
the open (nonzero) entries of each bond's gate; a pruned feed-forward pair counts as two cores
around one bond, its hidden neurons (``neuron_gates.py``). Its differentiable surrogate R is the mean of
|g| over the open entries (an l1 relaxation). Early stage: minimize L + beta * R. Late stage:
drive towards a target (L0, S0) along the subgradient of max{(L - L0)/L, (S - S0)/S}: the
size term when size is the worse-off objective, the task loss otherwise, plus a small
weighted-sum term.

With a target ratio, S0 is the scheduled budget of the step (``budget.py``), and entries close
by importance whenever the size is over it: an exponential moving average of (g * dL/dg)^2 per
gate entry, weighed against the parameters the entry frees. Half of it is the second-order
(empirical Fisher, Optimal Brain Damage) estimate of the loss increase if the entry closed; L is
the step's objective, whose task loss dominates while the size keeps to its budget. The
first-order |g * dL/dg| (AdaLoRA's sensitivity) ranks worse once training has settled the gates,
where the gradient averages to zero whatever an entry is worth (docs/findings.md).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..conversion import count_params
from ..conversion.targets import last_block_prefix
from ..errors import ConfigError
from ..hf.config import integer_format_of
from ..layers import TTModule
from .budget import (FALLBACK_KEPT_SHARES, MIN_KEPT_SHARE, ModuleBonds, bond_floor, choose_closures)
from .neuron_gates import NeuronBond, attach_neuron_gates, neuron_bonds
from .opening import dense_block_linears, open_dense_layers
from .speed_goal import SpeedGoal
from .stages import EARLY, LATE, RankState, StageSchedule

logger = logging.getLogger("comera_convert.training")

# Smoothing of the importance scores across steps (AdaLoRA's 0.85): one batch's gradient is noisy.
IMPORTANCE_DECAY = 0.85
# A run reaches its target ratio when the model holds at most this much more than dense / target.
TARGET_TOLERANCE = 0.02
# The most of a model's measured time its gates' prices may add up to: attention's products, norms and the
# embedding take the rest, and no gate closes them.
GATED_SHARE_CAP = 0.9


def gated_tt_layers(model: nn.Module) -> list[tuple[str, TTModule]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TTModule) and m.gates is not None]


def gated_modules(model: nn.Module) -> list[tuple[str, TTModule | NeuronBond]]:
    """Every bond the budget can close, in the model's order: the gated TT layers and the gated
    pruned pairs (by the name of their down side)."""
    bonds = dict(neuron_bonds(model))
    return [(n, bonds.get(n, m)) for n, m in model.named_modules()
            if (isinstance(m, TTModule) and m.gates is not None) or n in bonds]


def physical_sizes(module: TTModule | NeuronBond) -> list[int]:
    """Per core, the product of its physical (non-rank) dimensions (per side of a pruned pair: what one
    neuron holds there)."""
    if isinstance(module, NeuronBond):
        return module.physical_sizes()
    return [math.prod(shape[1:-1]) for shape in module.spec.core_shapes()]


def module_size(module: TTModule, ranks: tuple[int, ...] | None = None) -> int:
    """Stored entries of the module's cores at its open ranks (what truncation would keep), or at
    ``ranks``."""
    open_ranks = (1,) + (module.ranks if ranks is None else tuple(ranks)) + (1,)
    return sum(n * open_ranks[k] * open_ranks[k + 1] for k, n in enumerate(physical_sizes(module)))


def exported_gates(module: TTModule | NeuronBond, ranks: tuple[int, ...] | None = None) -> int:
    """Gate entries the export keeps at the open ranks (or at ``ranks``): a TT layer's, one per open
    index; none of a pruned pair's, whose gate is folded into its down layer."""
    if isinstance(module, NeuronBond):
        return 0
    return sum(module.ranks if ranks is None else ranks)


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


@torch.no_grad()
def _close_masked(module: TTModule, masks: list[torch.Tensor]) -> None:
    """Zero every gate entry its mask marks closed, and the core slices on both sides of it."""
    for gate, mask in zip(module.gates, masks):
        gate.mul_(mask)
    module.zero_pruned_()


class RankController:
    """Gates of every bond of a model (TT ranks, pruned pairs' neurons): size, surrogate, pruning and the
    staged objective."""

    def __init__(self, model: nn.Module, options, dense_params: int):
        if any(isinstance(m, TTModule) for m in model.modules()) and not gated_tt_layers(model):
            raise ConfigError("the model has no rank gates, so CoMERA's rank adaptation cannot run: "
                              "convert it with gates (leave out --no-gates)")
        self.model = model
        self.options = options
        self.dense_params = dense_params
        self.schedule = StageSchedule(options)  # when the stages run, and the budget's schedule
        # Every pruned feed-forward pair's hidden width is a bond too (neuron_gates.py).
        self.gated_pairs = attach_neuron_gates(model)
        self.modules = gated_modules(model)
        # Dense linears of the blocks made gated pairs because the target ratio lay beyond the gates (opening.py).
        self.opened: list[str] = []
        # With --target-speedup the budget counts time: what one open entry of each bond costs (microseconds a
        # batch, ``head_for_speed``), and the cost the late stage heads for; None counts parameters.
        self.prices: list[list[float]] | None = None
        self.speed: SpeedGoal | None = None
        if options.target_ratio is not None and not self.reachable(options.target_ratio):
            self.open_to_gates(f"target ratio {options.target_ratio:g}")
        if not self.modules:
            remedy = ("give --target-ratio (the dense layers of its blocks then open to the gates)"
                      if options.target_ratio is None else
                      "no dense layer could open to the gates (an integer checkpoint, or a model without a stack of "
                      "blocks, keeps its layers as they are)")
            raise ConfigError("the model has no TT layers and no pruned feed-forward pairs, so CoMERA's rank "
                              f"adaptation has nothing to adapt: {remedy}, or convert it with TT layers "
                              "(--word-embedding tt)")
        # Open entries per gate. Closed is for good: an optimizer step's momentum must not reopen
        # an entry. A gate that starts at zero (a resumed, expanded checkpoint) starts closed.
        self.sync_open()
        self.importance = [[torch.zeros(len(g)) for g in m.gates] for _, m in self.modules]
        # The fewest entries each bond keeps under the budget, from its rank as training starts: a
        # quarter, or less where the target ratio needs it.
        self.kept_share = MIN_KEPT_SHARE
        self.floors = self.floors_at(MIN_KEPT_SHARE)
        if options.target_ratio is not None:
            self.choose_floors(options.target_ratio)
            self.check_target(options.target_ratio)

    @property
    def state(self) -> RankState:
        """What a checkpoint carries (the schedule's: a resumed run sets it here)."""
        return self.schedule.state

    @state.setter
    def state(self, state: RankState) -> None:
        self.schedule.state = state

    def sync_open(self) -> None:
        """Take the open entries from the gates as they are (after loading a checkpoint)."""
        self.open = [[(g.detach() != 0) for g in m.gates] for _, m in self.modules]

    # -- measurements -------------------------------------------------------------------------------
    def size(self) -> int:
        """S: entries the TT cores keep at the open ranks."""
        return sum(module_size(m) for _, m in self.modules)

    def cost(self, bond_floors: list[list[int]] | None = None) -> int:
        """What the budget counts: the size S, or with a speed target the gates' time (each bond's open
        entries, or as many as ``bond_floors`` keep, times its price), in whole microseconds a batch."""
        if self.prices is None:
            return self.size()
        floors = bond_floors or [[None] * len(p) for p in self.prices]
        return round(sum(price * (rank if floor is None else min(floor, rank))
                         for (_, module), prices, bonds in zip(self.modules, self.prices, floors)
                         for rank, price, floor in zip(module.ranks, prices, bonds)))

    def model_params(self) -> int:
        """The whole model's parameter count once closed ranks are truncated away."""
        total = count_params(self.model)  # a codebook table's codes included
        for _, module in self.modules:
            stored = sum(c.numel() for c in module.cores) + sum(g.numel() for g in module.gates)
            total += module_size(module) + exported_gates(module) - stored
        return total

    def ratio(self) -> float:
        return self.dense_params / max(self.model_params(), 1)

    def measurements(self) -> dict:
        """Size, ratio and stage now, for the history (each counted once); with a target ratio, also
        the target ratio and the ratio the step's budget allows; with a speed target, the speed the prices
        estimate and --target-speedup."""
        size, params = self.size(), self.model_params()
        record = {"size": size, "ratio": self.dense_params / max(params, 1), "stage": self.state.stage}
        if self.options.target_ratio is not None:
            record["target_ratio"] = self.options.target_ratio
            if self.state.budget is not None:
                record["budget_ratio"] = self.dense_params / max(params - size + self.state.budget, 1)
        if self.speed is not None:
            record.update(target_speedup=self.options.target_speedup, speedup=self.speed.estimate(self.cost()))
        return record

    def floors_at(self, share: float) -> list[list[int]]:
        """Each bond's floor when bonds keep ``share`` of their rank now (those of the last block at
        least ``last_block_floor``)."""
        last_block, kept_there = last_block_prefix(self.model), self.options.last_block_floor or 0.0
        return [[bond_floor(r, self.options.rank_multiple,
                            max(share, kept_there) if last_block and name.startswith(last_block) else share)
                 for r in m.ranks] for name, m in self.modules]

    def choose_floors(self, target_ratio: float) -> None:
        """The largest kept share (a quarter, then ``FALLBACK_KEPT_SHARES``) whose floors let the
        model reach ``target_ratio``; the last one tried where none does (check_target then says so)."""
        for share in (MIN_KEPT_SHARE, *FALLBACK_KEPT_SHARES):
            self.kept_share, self.floors = share, self.floors_at(share)
            if self.ceiling() >= target_ratio:
                if share == 0:
                    logger.warning("target ratio %g needs every bond open to rank 1 and every pruned pair to one "
                                   "neuron (a sixteenth of each would stop short): layers may be all but cut off; "
                                   "a lower --target-ratio keeps more", target_ratio)
                elif share < MIN_KEPT_SHARE:
                    logger.info("target ratio %g: bonds may close down to %s (a quarter of each rank would "
                                "stop short)", target_ratio, self.floor_description())
                return

    def floor_params(self, bond_floors: list[list[int]] | None = None) -> int:
        """The whole model's parameter count with every bond closed down to its floor (``bond_floors``,
        or the run's)."""
        total = self.model_params()
        for (_, module), floors in zip(self.modules, self.floors if bond_floors is None else bond_floors):
            floors = tuple(min(f, r) for f, r in zip(floors, module.ranks))
            total += (module_size(module, floors) + exported_gates(module, floors)
                      - module_size(module) - exported_gates(module))
        return total

    def ceiling(self, bond_floors: list[list[int]] | None = None) -> float:
        """The ratio the model reaches with every bond at its floor (``bond_floors``, or the run's)."""
        return self.dense_params / self.floor_params(bond_floors)

    def reachable(self, target_ratio: float) -> bool:
        """Whether the gates reach ``target_ratio`` with every bond kept at a quarter of its rank (closing
        more of fewer layers keeps less than spreading the cut over the layers the conversion left dense)."""
        return bool(self.modules) and self.ceiling(self.floors_at(MIN_KEPT_SHARE)) >= target_ratio

    def open_to_gates(self, target: str) -> None:
        """Make the dense linears of the blocks gated full-rank pairs (``opening.py``), so that the
        budget can shrink them too; an integer checkpoint's grid is left as it is (nothing opens)."""
        names = dense_block_linears(self.model)
        if not names or integer_format_of(self.model) is not None:
            return
        added = open_dense_layers(self.model, names)
        self.modules, self.opened = gated_modules(self.model), names
        logger.info("%s lies beyond the gates: %d dense layers of the blocks open to them as exact "
                    "full-rank pairs (+%.2f M parameters until the budget closes their directions; the model "
                    "starts at %.2fx)", target, len(names), added / 1e6, self.ratio())

    # -- a speed target (--target-speedup) -------------------------------------------------------------
    def head_for_speed(self, goal: "SpeedGoal", price) -> None:
        """Count the budget in time: ``price(modules)`` gives each bond's price (microseconds a batch an open
        entry costs, ``hf/gate_prices.py``); the late stage heads for the cost at which the model runs
        ``goal``'s target speed. Dense layers of the blocks open to the gates where the gates' floors (a
        quarter of each rank) would not reach it; lower floors are tried as --target-ratio tries them.
        Refuses a target at or below the model's speed now, or beyond what every floor allows."""
        self.prices, self.speed = self._within(price(self.modules), goal), goal
        goal.start_cost = self.cost()
        if goal.estimate(self.cost(self.floors_at(MIN_KEPT_SHARE))) < self.target_speedup:
            self.open_to_gates(f"target speedup {self.target_speedup:g}")
            self.prices = self._within(price(self.modules), goal)
            self.importance = [[torch.zeros(len(g)) for g in m.gates] for _, m in self.modules]
            self.sync_open()
            goal.start_cost = self.cost()  # the opened layers compute what they did: the same time
        now = goal.estimate(goal.start_cost)
        if self.target_speedup <= now * (1 + 1e-3):
            raise ConfigError(f"target speedup {self.target_speedup:g} is not above the model's speed now, "
                              f"{now:.2f}x the dense model's in {goal.runtime}: training only compresses further "
                              "(ask for more, or leave out --target-speedup)")
        for share in (MIN_KEPT_SHARE, *FALLBACK_KEPT_SHARES):
            self.kept_share, self.floors = share, self.floors_at(share)
            if goal.estimate(self.cost(self.floors)) >= self.target_speedup:
                return
        fastest = goal.estimate(self.cost(self.floors))
        raise ConfigError(f"target speedup {self.target_speedup:g} is beyond what the smallest ranks allow in "
                          f"{goal.runtime}: about {fastest:.2f}x with every bond at rank 1 and every pruned pair at "
                          f"one neuron (the rest of the model, attention and norms, does not shrink); ask for at "
                          f"most {fastest:.2f}")

    def _within(self, prices: list[list[float]], goal: "SpeedGoal") -> list[list[float]]:
        """``prices`` scaled down where they add up to more than ``GATED_SHARE_CAP`` of the model's measured
        time (a chain of one layer runs slower than the same layer amid a whole graph): the gates cannot
        cost more than the model they are part of."""
        self.prices = prices
        gated, cap = self.cost(), GATED_SHARE_CAP * goal.model_microseconds
        if gated <= cap:
            return prices
        logger.info("the gates' prices add up to %.0f of the model's %.0f microseconds a batch: scaled to %.0f",
                    gated, goal.model_microseconds, cap)
        return [[price * cap / gated for price in bonds] for bonds in prices]

    @property
    def target_speedup(self) -> float:
        return self.options.target_speedup

    def check_target(self, target_ratio: float) -> None:
        """Refuse a target the run cannot head for: at or below the current ratio, or beyond the floors."""
        ratio = self.ratio()
        if target_ratio <= ratio * (1 + 1e-3):
            raise ConfigError(f"target ratio {target_ratio:g} is not above the model's current ratio "
                              f"{ratio:.2f}x: training only compresses further (ask for more, or leave out "
                              "--target-ratio)")
        ceiling = self.ceiling()
        if target_ratio > ceiling:
            raise ConfigError(f"target ratio {target_ratio:g} is beyond what the smallest ranks allow: "
                              f"{ceiling:.2f}x with every bond at its floor ({self.floor_description()}), "
                              f"and {self.ungated_params() / 1e6:.2f} M parameters outside the gates (embedding "
                              f"tables, norms, biases, layers outside the blocks); ask for at most "
                              f"{ceiling:.2f}, or convert at a "
                              "higher --ratio first")

    def ungated_params(self) -> int:
        """Parameters no gate can shrink: everything but the gated modules' cores and gates."""
        gated = sum(module_size(m) + exported_gates(m) for _, m in self.modules)
        return self.model_params() - gated

    def floor_description(self) -> str:
        """The floor in words: rank 1, or the share of each bond's rank when training started."""
        return "rank 1" if self.kept_share == 0 else f"{self.kept_share:g} of its starting rank"

    def ranks(self) -> dict[str, tuple[int, ...]]:
        return {name: module.ranks for name, module in self.modules}

    def surrogate(self) -> torch.Tensor:
        """R: mean |g| over open gate entries (differentiable)."""
        gates = torch.cat([g.abs().reshape(-1) for _, m in self.modules for g in m.gates])
        open_entries = (gates.detach() > 0).sum().clamp_min(1)
        return gates.sum() / open_entries

    def reindex(self, index: int, keep: list[torch.Tensor]) -> None:
        """The per-entry records of gated module ``index`` after its bonds were cut to the ``keep``
        indices (``rank_cuts.py``): the open masks and the importance scores of the entries kept."""
        self.open[index] = [mask[idx.to(mask.device)] for mask, idx in zip(self.open[index], keep)]
        self.importance[index] = [score[idx.to(score.device)] for score, idx in zip(self.importance[index], keep)]

    # -- pruning --------------------------------------------------------------------------------------
    @torch.no_grad()
    def prune(self) -> int:
        """Close gate entries below tau for good (gate and core slices zeroed); returns how many closed.

        Runs after every optimizer step; it also puts back to zero the closed entries that the
        step moved (AdamW's momentum keeps moving them), so closed stays closed. With a target
        ratio the budget decides every closure instead (``enforce_budget``: a gate near zero has
        near-zero importance, so it goes first), and the size lands on the target ratio, not below it.
        """
        closed = 0
        by_tau = not self.options.budgeted
        for (_, module), masks in zip(self.modules, self.open):
            for i, gate in enumerate(module.gates):
                mask = masks[i] = masks[i].to(gate.device)  # the model may have moved (Trainer, .cuda())
                if by_tau:
                    newly = self._below_tau(gate, mask)
                    mask &= ~newly
                    closed = closed + newly.sum()
            _close_masked(module, masks)
        return int(closed)  # the one host sync of the step

    def _below_tau(self, gate: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The open entries of ``gate`` that fall below tau and may close (on the device: no host sync)."""
        newly = mask & (gate.abs() < self.options.tau)
        # Never close a bond's last open entry: spare the strongest when nothing else stays open.
        strongest = torch.zeros_like(mask).scatter_(0, (gate.abs() * mask).argmax().reshape(1), True)
        newly &= ~(strongest & ~(mask & ~newly).any())
        if self.options.rank_multiple > 1:
            newly = whole_multiples(newly, mask, gate, self.options.rank_multiple)
        return newly

    # -- the budget (--target-ratio) ------------------------------------------------------------------
    @torch.no_grad()
    def observe_gradients(self) -> None:
        """Fold this step's (g * dL/dg)^2 into each gate entry's importance (after backward, before
        the optimizer step; under DDP the gradients are already averaged, so every replica agrees)."""
        for (_, module), scores in zip(self.modules, self.importance):
            for k, gate in enumerate(module.gates):
                if gate.grad is None:
                    continue  # a skipped (non-finite) step
                score = scores[k] = scores[k].to(gate.device)  # the model may have moved (Trainer, .cuda())
                score.mul_(IMPORTANCE_DECAY).add_((gate.detach() * gate.grad).float().square(),
                                                  alpha=1 - IMPORTANCE_DECAY)

    def importance_lists(self) -> list[list[float]]:
        """The importance scores as JSON-ready lists (for a training checkpoint), gate by gate."""
        return [score.tolist() for scores in self.importance for score in scores]

    def load_importance(self, lists: list[list[float]]) -> None:
        flat = iter(lists)
        self.importance = [[torch.tensor(next(flat)) for _ in m.gates] for _, m in self.modules]

    @torch.no_grad()
    def enforce_budget(self, step: int) -> int:
        """Close the least important entries per parameter freed until the size is within the
        step's budget (or every bond is at its floor); returns how many closed."""
        budget = self.state.budget = self.schedule.budget_at(step)
        if budget is None:
            return 0
        excess = self.cost() - budget
        if excess <= 0:
            return 0
        prices = self.prices or [None] * len(self.modules)
        plan = [self._bonds(module, scores, floors, bond_prices)
                for (_, module), scores, floors, bond_prices in zip(self.modules, self.importance, self.floors, prices)]
        choose_closures(plan, excess, self.options.rank_multiple)
        closed = 0
        for (_, module), masks, bonds in zip(self.modules, self.open, plan):
            for k, indices in bonds.closing.items():
                masks[k][torch.tensor(indices, device=masks[k].device)] = False
                closed += len(indices)
            if bonds.closing:
                _close_masked(module, masks)
        return closed

    def _bonds(self, module: TTModule, scores: list[torch.Tensor], floors: list[int],
               prices: list[float] | None = None) -> ModuleBonds:
        opened, importance = [], []
        for gate, score in zip(module.gates, scores):
            indices = (gate.detach() != 0).cpu().nonzero().flatten()
            values = score.cpu()[indices]
            weakest_first = values.argsort(stable=True)
            opened.append(indices[weakest_first].tolist())
            importance.append(values[weakest_first].tolist())
        return ModuleBonds(physical_sizes(module), opened, importance, floors, prices)

    def shortfall(self, step: int) -> str | None:
        """One line saying why, when a target ratio (or speed) is given and the model is not within
        tolerance of it (a speed by the prices' estimate: the run measures the one reached); None when it is."""
        if self.speed is not None:
            target_cost = self.state.target_size
            if target_cost is not None and self.cost() <= target_cost * (1 + TARGET_TOLERANCE) + 1:
                return None
            reached = (f"target speedup {self.target_speedup:g}x missed: the prices put the model at "
                       f"{self.speed.estimate(self.cost()):.2f}x")
            return self._why_short(step, reached, "--target-speedup")
        target = self.options.target_ratio
        if target is None or self.model_params() <= self.dense_params / target * (1 + TARGET_TOLERANCE):
            return None
        return self._why_short(step, f"target ratio {target:g}x missed: reached {self.ratio():.2f}x", "--target-ratio")

    def _why_short(self, step: int, reached: str, flag: str) -> str:
        if self.state.stage != LATE:
            return f"{reached}, the run ended in the early stage (step {step}): lower --early-steps"
        schedule = self.schedule
        if schedule.timed() and schedule.schedule_progress(step) < 1:
            return (f"{reached}, the --minutes budget ran out at step {step}, "
                    f"{schedule.schedule_progress(step):.0%} of the way down its budget schedule: "
                    "give more --minutes, or fewer --steps (the schedule follows whichever runs out first)")
        if not schedule.timed() and step < schedule.schedule_end():
            return (f"{reached}, the run stopped at step {step} before its budget schedule's end "
                    f"(step {schedule.schedule_end()}): resume it (--resume) or train longer")
        return (f"{reached}: every bond is at its floor ({self.floor_description()}); a lower "
                f"{flag} or --rank-multiple, or a conversion at a higher --ratio, would reach it")

    def switch(self, step: int) -> None:
        """Enter the late stage: fix the switch's point (L0, S0)."""
        size = self.size()
        self.state.stage, self.state.switch_step, self.state.size_at_switch = LATE, step, size
        self.state.switch_progress = self.schedule.run_progress(step)
        if self.speed is not None:
            # The gates must shed what the model runs over --target-speedup's time: its cost now less that excess.
            self.state.size_at_switch = size = self.cost()
            self.state.target_size = max(1, size - round(self.speed.excess_microseconds(size)))
        elif self.options.target_ratio is not None:
            # The whole model must hold dense_params / target_ratio: the TT part gets what the rest
            # leaves (the gates counted at the current ranks, so the size lands on the target ratio, never past it).
            rest = self.model_params() - size
            self.state.target_size = max(1, int(self.dense_params / self.options.target_ratio) - rest)
        else:
            self.state.target_size = max(1, int(size * self.options.target_fraction))
        self.state.target_loss = (self.options.target_loss if self.options.target_loss is not None
                                  else self.state.loss_ema)

    def objective(self, task_loss: torch.Tensor) -> torch.Tensor:
        """The loss to minimize this step, by stage."""
        beta = self.options.beta
        surrogate = self.surrogate()
        budgeted = self.options.budgeted and self.options.late_objective == "task"
        if self.state.stage == EARLY or budgeted:
            return task_loss + beta * surrogate
        loss_value = float(task_loss.detach())
        size = self.cost()
        target_size = self.state.budget if self.state.budget is not None else self.state.target_size
        loss_gap = (loss_value - self.state.target_loss) / max(abs(loss_value), 1e-12)
        size_gap = (size - target_size) / max(size, 1)
        worse = self.options.late_rank_weight * surrogate if size_gap > loss_gap else task_loss
        return worse + self.options.late_weighted_sum * (task_loss + beta * surrogate)
