"""The late stage's size budget with --target-ratio: a schedule from the size at the switch down to
the target ratio, and which gate entries close to meet it.

CoMERA's gates move by about the gate learning rate per step, so on their own they cannot close
an entry in a run of practical length (1.0 -> tau = 1e-2 takes ~1000 steps at 1e-3). With a target
ratio the late stage therefore holds a budget: the TT size allowed at each step falls from the
size at the switch to the target ratio along a cubic (AdaLoRA's schedule, Zhang et al., ICLR 2023):
quickly at first, while many entries are barely used, slowly near the target ratio, where every
closure costs more. Whenever the size is over budget, the open entries whose importance per
parameter freed is lowest close for good, but no bond below a quarter of its starting rank (a
bond emptied to rank 1 cuts its layer off; the floor keeps more, docs/findings.md), or the largest
lower share that lets the target ratio be
reached. The rest of the late stage trains at the reached
ranks, so the cores recover from the last closures before export.

Pure bookkeeping on host lists: no module, no tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Default share of the late stage over which the budget falls to the target ratio (--budget-share); the rest
# trains at the final ranks (as AdaLoRA's last steps). Over three quarters too little time was left at the
# final shapes (docs/findings.md).
SCHEDULE_SHARE = 0.15


def scheduled_size(start: int, target: int, progress: float) -> int:
    """The size allowed at ``progress`` (0 at the switch, 1 at the schedule's end) of the decrease."""
    progress = min(max(progress, 0.0), 1.0)
    return target + round((start - target) * (1.0 - progress) ** 3)


# The fewest entries a bond keeps, as a share of its rank when training started.
MIN_KEPT_SHARE = 0.25
# Lower shares tried in turn when the target ratio needs them (a mild conversion heading for a hard ratio,
# where the word table holds most of the cut, stops short of it at a quarter); 0 keeps one entry per bond.
FALLBACK_KEPT_SHARES = (0.125, 0.0625, 0.0)


def bond_floor(start_rank: int, multiple: int = 1, share: float = MIN_KEPT_SHARE) -> int:
    """The fewest open entries a bond of ``start_rank`` keeps: ``share`` of it (a quarter), at least
    one, and a multiple of ``multiple`` where the bond holds one (a bond smaller than that keeps its
    entries)."""
    floor = max(1, math.ceil(share * start_rank))
    return min(start_rank, math.ceil(floor / multiple) * multiple)


def closable(open_count: int, multiple: int, floor: int = 1) -> int:
    """How many entries of a bond with ``open_count`` open close next: enough to reach the next
    lower multiple of ``multiple``, none when that would take the bond below ``floor``."""
    unit = open_count % multiple or multiple
    return unit if open_count - unit >= max(floor, 1) else 0


@dataclass
class ModuleBonds:
    """One TT module's bonds as the budget sees them.

    ``physical[k]``: the product of core k's physical (non-rank) dimensions; ``open[k]``: the open
    entries of bond k (between cores k and k+1), weakest first; ``importance[k]``: their scores,
    aligned with ``open[k]``; ``floors[k]``: the fewest entries bond k keeps (default 1);
    ``prices[k]``: what one entry of bond k costs in a budget counted in time (microseconds a batch,
    measured: ``hf/gate_prices.py``), None where the budget counts parameters.
    """

    physical: list[int]
    open: list[list[int]]
    importance: list[list[float]]
    floors: list[int] | None = None
    prices: list[float] | None = None
    closing: dict[int, list[int]] = field(default_factory=dict)

    def floor(self, bond: int) -> int:
        return self.floors[bond] if self.floors is not None else 1

    def rank(self, bond: int) -> int:
        """Open count of bond ``bond``; the boundary ranks (-1 and len) are 1."""
        return len(self.open[bond]) if 0 <= bond < len(self.open) else 1

    def freed_per_entry(self, bond: int) -> float:
        """What closing one entry of ``bond`` frees: its price where the budget counts time, else the stored
        entries (a slice of each neighbouring core, and the gate's entry)."""
        if self.prices is not None:
            return self.prices[bond]
        return self.physical[bond] * self.rank(bond - 1) + self.physical[bond + 1] * self.rank(bond + 1) + 1

    def close_weakest(self, bond: int, count: int) -> None:
        self.closing.setdefault(bond, []).extend(self.open[bond][:count])
        del self.open[bond][:count], self.importance[bond][:count]


def choose_closures(modules: list[ModuleBonds], excess: int, multiple: int = 1) -> int:
    """Close entries (recorded in each module's ``closing``) until at least ``excess`` is freed (stored
    entries, or microseconds where the budget counts time) or every bond is at its floor; returns
    what was freed.

    Greedy on importance per unit freed: each round closes the unit (one entry, or enough to reach
    the next lower multiple) whose summed importance over what it frees is least, among the units
    that fit in what is left to free; when none fits, the smallest unit, so the size lands as close
    under the budget as the units allow. A bond's parameters depend on its neighbours' ranks, so
    they are recomputed every round; a bond that frees nothing (no time, where time is counted) is
    left open.
    """
    freed = 0
    while freed < excess:
        units = [(sum(module.importance[bond][:count]) / saving, saving, module, bond, count)
                 for module in modules for bond in range(len(module.open))
                 for count in [closable(len(module.open[bond]), multiple, module.floor(bond))] if count
                 for saving in [count * module.freed_per_entry(bond)] if saving > 0]
        if not units:
            break  # every bond at its floor
        fitting = [unit for unit in units if unit[1] <= excess - freed]
        _, saving, module, bond, count = (min(fitting, key=lambda u: u[0]) if fitting
                                          else min(units, key=lambda u: (u[1], u[0])))
        module.close_weakest(bond, count)
        freed += saving
    return freed
