"""Ordered directions for rank adaptation: trained low-rank pairs re-projected into the basis of
their inputs (``--reproject``).

A gate closes one rank-1 slice of a layer. Right after conversion those slices are the whitened
singular directions, ordered by how much of the layer's output they carry on real inputs; training
rotates the factors, and closing entries of a trained pair then drops directions chosen at the
start. Re-projection puts each gated low-rank pair (a ``TTLinear`` of one bond) back into that
order on the inputs it sees now, once, at the stage switch (the first rank cut, ``rank_cuts.py``):
the pair W = A diag(g) B is rewritten exactly as A' diag(sigma) B' (``tt.weighted.whitened_pair``),
with the inputs' Gram matrix gathered from the training batches by forward hooks, one step in
``GRAM_EVERY``. The cores take sigma, each direction's column and row of one norm
(``tt.weighted.equal_norm_pair``), the gates restart at 1, and AdamW's state of the
pair keeps its scale (``rescale_moments``): the first moment is forgotten (its directions are
new), the second is averaged over the rank axis (the axis the new basis mixes), and the step count
stays, where a restart would move every entry by the full rate (Adam's first steps are the
gradient's sign). The importance the budget closes entries by is redistributed over the new
directions in proportion to sigma squared, the layer's total kept: the layers' shares of the
budget stay as the gradients measured them, and inside a layer the weakest direction goes first
until new gradients refine it.
"""

from __future__ import annotations

import logging

import torch

from ..layers import TTLinear
from ..tt.weighted import equal_norm_pair, input_factor, whitened_pair

logger = logging.getLogger("comera_convert.training")

# Steps between two batches whose inputs enter the Gram matrices: a Gram update costs a tokens x
# width x width product per layer, an eighth of a step's share of it is noise on the step time.
GRAM_EVERY = 8


def reprojectable(module) -> bool:
    """A gated low-rank pair: a tt-layout ``TTLinear`` of two cores, unpadded."""
    return (isinstance(module, TTLinear) and module.gated and module.layout == "tt" and len(module.cores) == 2
            and module.cores[0].shape[1] == module.in_features and module.cores[1].shape[1] == module.out_features)


class GramRecorder:
    """Sums x^T x of the inputs of every re-projectable gated layer while ``active``."""

    def __init__(self, modules: list[tuple[str, object]]):
        self.grams: dict[int, torch.Tensor] = {}
        self.active = False
        self.handles = [module.register_forward_pre_hook(self._hook(index))
                        for index, (_, module) in enumerate(modules) if reprojectable(module)]

    def _hook(self, index: int):
        def record(module, args):
            if not self.active:
                return
            flat = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            gram = flat.T @ flat
            self.grams[index] = gram if index not in self.grams else self.grams[index] + gram
        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def rescale_moments(optimizer, param: torch.Tensor, rank_axis: int) -> None:
    """AdamW's state of ``param`` after its ``rank_axis`` was rotated into a new basis: the first
    moment is forgotten, the second moment becomes its mean over that axis (each input or output
    feature keeps the scale of its gradients, every new direction gets the average one), and the
    step count is kept, so the next steps move as far as the last ones did."""
    state = optimizer.state.get(param) if optimizer is not None else None
    if not state:
        return
    if torch.is_tensor(state.get("exp_avg")):
        state["exp_avg"].zero_()
    second = state.get("exp_avg_sq")
    if torch.is_tensor(second) and second.shape == param.shape:
        second.copy_(second.mean(dim=rank_axis, keepdim=True).expand_as(second))


def rescale_pair_moments(optimizer, module: TTLinear) -> None:
    """``rescale_moments`` for a re-projected pair: the rank is the last axis of the first core,
    the first axis of the second core, and the gate's only axis."""
    rescale_moments(optimizer, module.cores[0], rank_axis=module.cores[0].dim() - 1)
    rescale_moments(optimizer, module.cores[1], rank_axis=0)
    rescale_moments(optimizer, module.gates[0], rank_axis=0)


@torch.no_grad()
def reproject_pair_(module: TTLinear, gram: torch.Tensor) -> torch.Tensor | None:
    """Rewrite the module's pair in its ordered basis (same matrix); returns sigma, descending, or
    None, the pair left as it was, where the result is not finite (a Gram of non-finite inputs)."""
    if not torch.isfinite(gram).all():
        return None
    left = module.cores[0].reshape(module.in_features, -1) * module.gates[0]
    right = module.cores[1].reshape(-1, module.out_features)
    ordered, sigma, rows = whitened_pair(left, right, input_factor(gram)[0])
    # sigma grows with the tokens the Gram sums, and ordered's columns shrink with them: split
    # evenly by sigma's root, the first core came out 50x smaller than the second on MiniLM, and
    # AdamW's steps, one size on both, moved it by a large share of itself (the loss tripled).
    first, second = equal_norm_pair(ordered * sigma, rows)
    if not (torch.isfinite(first).all() and torch.isfinite(second).all()):
        return None
    module.cores[0].copy_(first.reshape(module.cores[0].shape))
    module.cores[1].copy_(second.reshape(module.cores[1].shape))
    module.gates[0].fill_(1.0)
    module.clear_cache()
    return sigma


def reproject(controller, optimizer, recorder: GramRecorder, step: int) -> int:
    """Re-project every gated pair with a Gram matrix and every bond open; returns how many. A pair
    whose re-projection is not finite keeps its factors (one warning names them)."""
    done, kept = 0, []
    for index, (name, module) in enumerate(controller.modules):
        gram = recorder.grams.get(index)
        if gram is None or not reprojectable(module) or module.ranks != module.bond_dims:
            continue
        sigma = reproject_pair_(module, gram)
        if sigma is None:
            kept.append(name)
            continue
        rescale_pair_moments(optimizer, module)
        scores = controller.importance[index][0]
        energy = sigma.to(scores).square()
        controller.importance[index][0] = scores.sum() * energy / energy.sum().clamp_min(1e-30)
        done += 1
    if kept:
        logger.warning("step %d: re-projection of %s was not finite (non-finite inputs): kept as trained",
                       step, ", ".join(kept))
    logger.info("step %d: %d low-rank pairs re-projected into their inputs' ordered basis", step, done)
    return done
