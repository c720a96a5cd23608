"""A pruned feed-forward pair's hidden width as one more bond of the rank budget.

A feed-forward pair ``down(act(up(x)))`` pruned by neuron (``layers/pruned_linear.py``) has a rank of
its own: its hidden width. A gate over the hidden neurons, between the activation and ``down``
(``PrunedLinear.add_neuron_gate_``), makes it a bond as CoMERA's gates make a TT rank one, and
structured pruning while training (CoFi's and Sheared-LLaMA's masks) closes neurons so: the budget
weighs each neuron's importance against the parameters it frees (a row of up and its bias, a column
of down: ``physical_sizes``), under the same schedule and floors as every rank, and a closed neuron is
cut out of both layers (``cut_to_open_ranks_``), so the pair gets narrower, its steps cheaper and its
export smaller.

``NeuronBond`` gives the pair the part of ``TTModule``'s interface the rank controller, the cuts and the
training checkpoints use: gates, open ranks, bond sizes, zeroing, cutting, and restoring a cut pair.
"""

from __future__ import annotations

import torch
from torch import nn

from ..conversion.pruning import pruned_partner
from ..errors import ComeraError, expected
from ..layers import PrunedLinear
from ..layers.base import expand_axis, listed, placed_like


class NeuronBond:
    """The hidden neurons of one pruned pair (``up``: pruned "out", ``down``: pruned "in", gated) as a bond."""

    def __init__(self, up: PrunedLinear, down: PrunedLinear):
        if down.gates is None:
            raise ValueError(expected("a down layer carrying a neuron gate", "an ungated one"))
        self.up, self.down = up, down

    # -- what the budget reads ----------------------------------------------------------------------
    @property
    def gates(self) -> list[nn.Parameter]:
        return listed(self.down.gates)

    @property
    def cores(self) -> list[torch.Tensor]:
        """The tensors whose size follows the hidden width: up's rows and bias, down's columns."""
        return [t for t in (self.up.weight, self.up.bias, self.down.weight) if t is not None]

    @property
    def bond_dims(self) -> tuple[int, ...]:
        return (self.down.in_features,)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Open neurons: nonzero gate entries."""
        return (int(torch.count_nonzero(self.gates[0].detach())),)

    def physical_sizes(self) -> list[int]:
        """Parameters a neuron holds on either side of the bond: up's row and bias entry, down's column."""
        return [self.up.in_features + (self.up.bias is not None), self.down.out_features]

    # -- closing and cutting --------------------------------------------------------------------------
    @torch.no_grad()
    def zero_pruned_(self) -> None:
        """Zero up's rows and bias entries and down's columns of every closed neuron (gate == 0)."""
        is_open = (self.gates[0] != 0).to(self.gates[0].dtype)
        self.up.weight.mul_(placed_like(is_open[:, None], self.up.weight))
        if self.up.bias is not None:
            self.up.bias.mul_(placed_like(is_open, self.up.bias))
        self.down.weight.mul_(placed_like(is_open[None, :], self.down.weight))

    def kept_indices(self) -> list[torch.Tensor]:
        """The open neurons (the strongest one where none is: a pair of width 0 computes nothing)."""
        gate = self.gates[0].detach()
        kept = (gate != 0).nonzero().flatten()
        return [kept if kept.numel() else gate.abs().argmax().reshape(1)]

    def _cuts(self, keep: torch.Tensor) -> list[tuple[torch.Tensor, object]]:
        """Each tensor of the pair with the function that keeps the ``keep`` neurons of a tensor of its shape."""
        rows = lambda t: t.index_select(0, keep)  # noqa: E731 - up's rows, its bias, the gate
        columns = lambda t: t.index_select(1, keep)  # noqa: E731 - down's columns
        return [(self.up.weight, rows), (self.down.weight, columns), (self.gates[0], rows)] + (
            [(self.up.bias, rows)] if self.up.bias is not None else [])

    @torch.no_grad()
    def cut_to_open_ranks_(self, on_cut=None) -> list[torch.Tensor]:
        """Cut the closed neurons out of both layers in place (each parameter stays the same object,
        only smaller, as ``TTModule.cut_to_open_ranks_`` does; ``on_cut(param, cut)`` before each shrinks);
        returns the kept indices."""
        keep = self.kept_indices()
        for param, cut in self._cuts(keep[0].to(self.gates[0].device)):
            if on_cut is not None:
                on_cut(param, cut)
            param.data = cut(param.data).contiguous()
            param.grad = None
        self._set_width(len(keep[0]))
        return keep

    def _set_width(self, width: int) -> None:
        self.up.out_features = self.down.in_features = width

    @torch.no_grad()
    def prune_ranks(self, fold: bool = True) -> tuple[int, ...]:
        """Cut the closed neurons out; ``fold`` folds the gate into down and drops it (an export),
        otherwise the gate is kept so that ``restore_`` can scatter the pair back (a training checkpoint)."""
        self.cut_to_open_ranks_()
        if fold:
            self.down.fold_neuron_gate_()
        return self.bond_dims

    @torch.no_grad()
    def restore_(self, tensors: dict[str, torch.Tensor], names: tuple[str, str], kept: list[int],
                 width: int) -> None:
        """Load a training checkpoint's cut pair (popped from ``tensors`` by the ``names`` of up and
        down) into this pair at ``width`` neurons: the saved ones at the ``kept`` positions, the others
        closed (zero gate, zero weights)."""
        up_name, down_name = names
        index = torch.as_tensor(kept, dtype=torch.long)
        saved = {"up.weight": tensors.pop(f"{up_name}.weight"), "down.weight": tensors.pop(f"{down_name}.weight"),
                 "gate": tensors.pop(f"{down_name}.gates.0")}
        if self.up.bias is not None:
            saved["up.bias"] = tensors.pop(f"{up_name}.bias")
        if len(index) != len(saved["gate"]) or (len(index) and int(index.max()) >= width):
            raise ComeraError(f"the training checkpoint's pair {down_name!r} does not fit: "
                              + expected(f"{len(saved['gate'])} kept neurons of {width}", kept))
        placed = {"up.weight": (self.up.weight, 0), "down.weight": (self.down.weight, 1), "gate": (self.gates[0], 0),
                  "up.bias": (self.up.bias, 0)}
        for key, small in saved.items():
            param, axis = placed[key]
            param.data = expand_axis(small, index, width, axis).to(device=param.device, dtype=param.dtype)
        self._set_width(width)


def pruned_pairs(model: nn.Module) -> list[tuple[str, str, PrunedLinear, PrunedLinear]]:
    """(up's name, down's name, up, down) of every pruned pair of the model, in the model's order."""
    modules = dict(model.named_modules())
    return [(up_name, name, modules[up_name], module) for name, module in modules.items()
            if isinstance(module, PrunedLinear) and module.pruned == "in"
            and (up_name := pruned_partner(name, modules)) is not None]


def attach_neuron_gates(model: nn.Module) -> int:
    """Give every pruned pair of the model a neuron gate (on its down side); returns how many pairs."""
    pairs = pruned_pairs(model)
    for _, _, _, down in pairs:
        down.add_neuron_gate_()
    return len(pairs)


def neuron_bonds(model: nn.Module) -> list[tuple[str, NeuronBond]]:
    """(down's name, its bond) for every pruned pair whose down carries a neuron gate, in the model's order."""
    return [(name, NeuronBond(up, down)) for _, name, up, down in pruned_pairs(model) if down.gates is not None]
