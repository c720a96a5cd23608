"""Putting a module in place of another, by its dotted name."""

from __future__ import annotations

from torch import nn


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """``root.set_submodule(name, module)``, which torch has from 2.5 only (the declared range starts
    at 2.4): the parent is looked up and the attribute set, as torch's own does."""
    parent, _, attribute = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attribute, module)
