"""Feed-forward pairs pruned by hidden neuron (``--ffn prune``, the plan's default where calibrated).

Where the allocation gives a block's feed-forward pair (up: hidden x in, down: out x hidden, an
elementwise activation between) low-rank specs, the pair can spend the same parameters on keeping
whole hidden neurons instead: the rows of up and columns of down of the neurons left after removing,
greedily, those whose loss costs down's output least on the calibration text once the others are
refit (``surviving_neurons``); down refit by least squares from the kept neurons' activations to the
dense pair's output (the calibration's statistics of down's input; where the calibration
compensates, the activations the compressed layers before it give, mapped onto the dense outputs
as ``compensated_matrix`` maps them), its bias set so that the mean output matches. The kept rows
of up are its dense rows, refit to the compressed inputs where the calibration compensates
(``compensate_up``), as every low-rank layer is.

Why: a feed-forward layer's hidden activations are not low-rank the way attention's projections
are, and a low-rank up confines every hidden neuron's input to one shared subspace; pruning keeps
the neurons it keeps exact. Pruned pairs keep more of the dense embeddings than whitened low-rank
pairs, on the feed-forward layers alone and in the whole pipeline, on MiniLM and all-mpnet-base-v2
(docs/findings.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..choices import INTEGER_STORAGE
from ..errors import ConfigError
from ..layers.pruned_linear import PrunedLinear
from ..tt.counting import num_params
from .calibration import Calibration, compensated_matrix, correct_bias

# The endings of a block's feed-forward pair (up, down) that have an elementwise activation between
# them: BERT, RoBERTa, MPNet, ELECTRA, DeBERTa name them so (intermediate.dense -> act -> output.dense).
FFN_PAIRS = (("intermediate.dense", "output.dense"),)
# The activations' covariance is damped by this share of its mean diagonal before down is refit
# (neurons that fire together would otherwise get large opposite weights).
REFIT_RIDGE = 1e-3
# Under int4 storage a pruned pair keeps a multiple of this many neurons: down's rows are as long as
# the neurons kept, int4 packs two values a byte and keeps a scale per group of a row's values that
# divides it (128 where it can): 1486 neurons (2 x 743) would get one scale a row, 1472 = 16 x 92 gets
# 16 groups of 92. At most 15 neurons fewer (1 % of a 3072-wide pair's at --ratio 2).
INT4_KEPT_MULTIPLE = 16
# Neurons are removed in this many groups (``surviving_neurons``): each group costs one update of the
# hidden x hidden inverse, and one at a time (1152 updates of a 3072-wide pair) would take minutes.
REMOVAL_GROUPS = 64


def ffn_pairs(candidates, specs) -> dict[str, str]:
    """up name -> down name for each feed-forward pair (``FFN_PAIRS``) of two nn.Linear candidates of
    matching widths that both have a spec (the allocation compresses both), down with a bias (the
    refit's intercept) and after up (the converter meets up first and holds it for down)."""
    found = {c.name: (c, spec) for c, spec in zip(candidates, specs)}
    order = {name: index for index, name in enumerate(found)}
    pairs = {}
    for name, (up, spec) in found.items():
        for up_end, down_end in FFN_PAIRS:
            down_name = _other_end(name, up_end, down_end)
            if spec is None or down_name is None:
                continue
            down, down_spec = found.get(down_name, (None, None))
            if (down is not None and down_spec is not None and order[down.name] > order[name]
                    and type(up.module) is nn.Linear
                    and type(down.module) is nn.Linear and down.module.bias is not None
                    and down.rows == up.cols and down.cols == up.rows):
                pairs[name] = down.name
    return pairs


def pruned_partner(name: str, modules: dict[str, nn.Module]) -> str | None:
    """The other side of the pruned pair that ``name`` belongs to (by ``FFN_PAIRS``), None where there is
    none: a pruned pair is put back, or kept, as a whole (its two widths must agree)."""
    for up_end, down_end in FFN_PAIRS:
        for end, other_end in ((up_end, down_end), (down_end, up_end)):
            other = _other_end(name, end, other_end)
            if isinstance(modules.get(other), PrunedLinear) and isinstance(modules.get(name), PrunedLinear):
                return other
    return None


def _other_end(name: str, end: str, other_end: str) -> str | None:
    """``name`` with its ending ``end`` (whole dot-separated parts) replaced by ``other_end``; None
    where it does not end so."""
    if name != end and not name.endswith("." + end):
        return None
    return name[:len(name) - len(end)] + other_end


def kept_multiple(rank_multiple: int, dtype: str | None, group_size: int | None = None) -> int:
    """What a pruned pair's kept neurons are a multiple of: the conversion's rank multiple, and under
    integer storage the group size given (each of down's rows splits into whole groups), or
    INT4_KEPT_MULTIPLE under int4 storage with the group size left to the rounding."""
    if dtype in INTEGER_STORAGE and group_size is not None:
        return math.lcm(rank_multiple, group_size)
    return math.lcm(rank_multiple, INT4_KEPT_MULTIPLE) if dtype == "int4" else rank_multiple


def kept_neurons(up, up_spec, down, down_spec, multiple: int = 1) -> int:
    """The hidden neurons the pair keeps for the parameters its two low-rank specs would take (their
    cores and up's full bias): a multiple of ``multiple`` (``kept_multiple``), at least one multiple
    and at most all."""
    budget = num_params(up_spec) + num_params(down_spec) + up.cols
    affordable = budget // (up.rows + down.cols + 1) // multiple * multiple
    return max(min(multiple, up.cols), min(up.cols, affordable))


@torch.no_grad()
def compensate_up(up: nn.Linear, name: str, stats: Calibration) -> None:
    """Where the calibration compensates (``stats.cross``), refit up in place to map the inputs the
    compressed layers before it give onto its dense outputs (``compensated_matrix``, as every
    low-rank layer is fit), its bias matching the dense mean output: the hidden activations down's
    statistics then record, and the rows the pair keeps, make up for the error before the pair."""
    if name not in stats.cross:
        return
    dense = up.weight.detach().clone()
    up.weight.copy_(compensated_matrix(dense.t(), stats.grams[name], stats.cross[name]).t())
    correct_bias(up, dense, name, stats)


@torch.no_grad()
def prune_pair(up: nn.Linear, down: nn.Linear, kept: int, down_name: str,
               stats: Calibration) -> tuple[PrunedLinear, PrunedLinear]:
    """The pair with ``kept`` hidden neurons (module docstring), on the device and in the dtype of the
    layers it replaces; ``stats`` must hold down's input statistics (``down_name``)."""
    if down_name not in stats.grams:
        raise ConfigError(f"pruning {down_name!r} needs the calibration statistics of its input, and there are none")
    gram, rows = stats.grams[down_name].double(), stats.rows[down_name]
    cross = stats.cross.get(down_name, gram).double()
    mean_seen = stats.sums[down_name].double() / rows
    mean_dense = stats.dense_sums.get(down_name, stats.sums[down_name]).double() / rows
    weight = down.weight.detach().double().cpu()
    # Least squares with an intercept: the centred second moments of the activations seen, and their
    # cross moments with the dense activations, which down's dense weight maps to the targets.
    covariance = gram - rows * torch.outer(mean_seen, mean_seen)
    covariance.diagonal().add_(REFIT_RIDGE * float(covariance.diagonal().mean()))
    target = (cross - rows * torch.outer(mean_seen, mean_dense)) @ weight.T  # (hidden, out)
    # The selection in float64, as the refit: in float32 its rounding (which the thread count and the
    # CPU's kernels change) decided between neurons of near-equal saliency, so the same conversion kept
    # other neurons on another machine. Float64 takes about twice as long (seconds at 3072 wide).
    inverse = _inverse(covariance)
    keep = surviving_neurons(inverse, inverse @ target, kept)
    refit = torch.linalg.solve(covariance[keep][:, keep], target[keep])  # (kept, out)
    bias = weight @ mean_dense - refit.T @ mean_seen[keep] + down.bias.detach().double().cpu()
    new_up = PrunedLinear(up.in_features, kept, bias=up.bias is not None, pruned="out",
                          dense_features=up.out_features, device=up.weight.device, dtype=up.weight.dtype)
    new_up.weight.copy_(up.weight[keep.to(up.weight.device)])
    if up.bias is not None:
        new_up.bias.copy_(up.bias[keep.to(up.bias.device)])
    new_down = PrunedLinear(kept, down.out_features, pruned="in", dense_features=down.in_features,
                            device=down.weight.device, dtype=down.weight.dtype)
    new_down.weight.copy_(refit.T)
    new_down.bias.copy_(bias)
    return new_up, new_down


def surviving_neurons(inverse: torch.Tensor, fit: torch.Tensor, kept: int) -> torch.Tensor:
    """The ``kept`` neurons (sorted indices) left after removing the others greedily, each time those
    whose removal, with the survivors refit, raises the squared error least: ||fit_j||^2 / [C^-1]_jj
    for the least-squares ``fit`` (hidden x out) under the activations' covariance C, given as its
    ``inverse`` (Optimal Brain Surgeon's saliency, by neuron, as structured OBS pruners such as ZipLM
    rank them). The fit and C^-1 are updated after each group, in place, and cut to the survivors:
    REMOVAL_GROUPS groups, so that a 3072-wide pair costs seconds, not minutes.
    Energy alone (E[h_j^2] ||down_j||^2) would keep two neurons that fire alike where one suffices."""
    inverse, fit = inverse.clone(), fit.clone()
    survivors = torch.arange(len(fit))  # their indices in the layer, in the order of inverse's rows
    remaining = len(fit) - kept
    for group in range(REMOVAL_GROUPS, 0, -1):
        size = -(-remaining // group)  # what is left, spread over the groups left
        if size <= 0:
            break
        saliency = fit.pow(2).sum(1) / inverse.diagonal()
        removed = torch.topk(saliency, size, largest=False).indices
        columns = inverse.index_select(1, removed)
        block = torch.linalg.inv(columns[removed])
        fit.addmm_(columns, block @ fit.index_select(0, removed), alpha=-1)
        inverse.addmm_(columns, block @ columns.T, alpha=-1)
        stay = torch.ones(len(survivors), dtype=torch.bool)
        stay[removed] = False
        stay = stay.nonzero().squeeze(1)
        inverse, fit, survivors = inverse[stay[:, None], stay], fit[stay], survivors[stay]
        remaining -= size
    return survivors.sort().values


def _inverse(covariance: torch.Tensor) -> torch.Tensor:
    """The inverse of a damped covariance by Cholesky, damped tenfold more where float32 rounding
    left it not quite positive definite (a neuron that never fires on the calibration text)."""
    factor, info = torch.linalg.cholesky_ex(covariance)
    if info:
        damped = covariance + 10 * REFIT_RIDGE * float(covariance.diagonal().mean()) * torch.eye(len(covariance))
        factor = torch.linalg.cholesky(damped)
    return torch.cholesky_inverse(factor)
