"""convert_modules(): swap a model's Linear / Conv1D / Embedding modules for TT modules, in place.

The model keeps its class and its forward. This is the torch half of ``comera_convert.convert``;
the public verb then records the compression in the model's config (``hf/``), so that
``save_pretrained`` writes a compressed checkpoint and transformers loads it back.
"""

from __future__ import annotations

import logging
import time

from torch import nn

from ..codebook import CodebookSpec
from ..errors import ConfigError
from ..layers import CodebookEmbedding, TTEmbedding, TTLinear, TTModule
from ..layers.swap import set_submodule
from ..layers.tt_linear import dense_weight_of
from ..tt.decompose import matrix_to_cores
from .allocate import LayoutChoice
from .calibration import Calibration, correct_bias, weighted_decomposer
from .hooks import IN_MEMORY, ModuleHooks
from .plan import ConvertPlan
from .pruning import compensate_up, ffn_pairs, kept_multiple, kept_neurons, prune_pair
from .records import tie_head
from .report import ConversionReport, describe
from .storage import integer_storage, round_in_place
from .strategies import STRATEGIES, UNIFORM_DESCRIPTION, Allocation, AllocationRequest
from .model_facts import count_params, input_embedding_names
from .targets import find_candidates

logger = logging.getLogger("comera_convert")


def convert_modules(model: nn.Module, options: ConvertPlan, calibration: Calibration | None = None,
                    hooks: ModuleHooks = IN_MEMORY, source: str | None = None) -> ConversionReport:
    """Swap ``model``'s modules for TT modules in place, as ``options`` (the request's plan) say; returns
    the report.

    calibration: ``calibrate(model, tokenizer, data)``'s statistics: each layer's decomposition then
        minimizes its error on those inputs (activation-aware TT-SVD; token-frequency-weighted
        embeddings) instead of its weight error.
    hooks: who hears of each module (progress) and, streaming, hands its weights in (load) and takes its
        TT module out (release): ``hooks.py``.

    Pure torch: what makes the result a transformers model that saves and loads compressed is
    ``comera_convert.convert`` (the public verb), which calls this and then the hf layer.
    """
    _check_convertible(model, options, calibration)
    start = time.perf_counter()
    params_before = count_params(model)
    candidates, tied, skipped = find_candidates(model, options.targets, options.exclude, options.d)
    if not candidates:
        raise ConfigError(_nothing_to_convert(model, skipped))
    choice = layout_choice(model, candidates, options)
    allocation = _allocate(model, candidates, params_before, options, choice, calibration, hooks.progress)
    for candidate, spec in zip(candidates, allocation.specs):
        if spec is None:
            skipped[candidate.name] = (f"TT at rank {allocation.shared_rank} would not be smaller"
                                       if allocation.shared_rank
                                       else f"kept dense by the {options.allocation} allocation")
    if options.request.ffn == "prune" and not ffn_pairs(candidates, allocation.specs):
        logger.warning("--ffn prune found no feed-forward pair to prune (a BERT-family block's intermediate.dense "
                       "-> output.dense, both compressed): the feed-forward layers are low-rank")
    swap_in(model, candidates, allocation.specs, options, calibration, hooks)
    _tie_heads(model, tied, {c.name for c, s in zip(candidates, allocation.specs) if s is not None}, skipped)
    report = describe(model, skipped=skipped, target_ratio=options.ratio, shared_rank=allocation.shared_rank,
                      seconds=time.perf_counter() - start, params_before=params_before, source=source)
    report.extra.update(allocation=allocation.description, **allocation.extra)
    if options.rank_multiple != 1:
        report.extra["rank_multiple"] = options.rank_multiple
    if calibration is not None:
        report.extra["calibration"] = calibration.describe()
    return report


def _check_convertible(model: nn.Module, options: ConvertPlan, calibration: Calibration | None) -> None:
    if options.calibration is not None and calibration is None:
        raise ConfigError(f"calibration {options.calibration!r} was requested but no statistics were given: "
                          f"pass calibration=calibrate(model, tokenizer, {options.calibration!r})")
    if any(isinstance(m, (TTModule, CodebookEmbedding)) for m in model.modules()):
        raise ConfigError("the model is already compressed: convert the dense model, "
                          "or retrain this one with `comera train`")


def _tie_heads(model: nn.Module, tied, converted: set[str], skipped: dict) -> None:
    """Each head tied to a converted table computes through it; one tied to a dense table stays as it is."""
    for head in tied:
        if head.embedding_name not in converted:
            skipped[head.name] = f"tied to the dense {head.embedding_name}"
            continue
        tie_head(model, head.name, {"embedding": head.embedding_name,
                                    "bias": getattr(head.module, "bias", None) is not None})


def codebook_tables(model: nn.Module, candidates, options: ConvertPlan) -> frozenset[str]:
    """The candidates held as codebook tables: the input embedding when options ask for one. A head
    tied to it (BERT's MLM decoder, GPT-2's lm_head) multiplies by the same dequantized rows
    (``TiedTTHead``), so tied tables are codebooks too."""
    if options.word_embedding != "codebook":
        return frozenset()
    return input_embedding_names(model, candidates)


def _allocate(model, candidates, params_before, options, choice, calibration, progress) -> Allocation:
    """The specs: a fixed --rank for every layer, or a strategy splitting the --ratio budget."""
    if options.rank is not None:
        # An explicit rank is honoured even where TT is not smaller (full-rank round trips, studies).
        return Allocation([choice.spec(c, options.rank) for c in candidates], options.rank,
                          UNIFORM_DESCRIPTION)
    request = AllocationRequest(
        model, candidates, params_before, options, choice, calibration,
        lambda clone, clone_candidates, trial: swap_in(clone, clone_candidates, trial, options, calibration),
        progress)
    return STRATEGIES[options.allocation](request)


def allocation_request(model: nn.Module, options: ConvertPlan) -> AllocationRequest:
    """What a strategy splits the budget of ``options`` over for ``model``, as ``convert_modules`` asks
    (without calibration: for learning an allocation before a streamed conversion)."""
    candidates = find_candidates(model, options.targets, options.exclude, options.d)[0]
    return AllocationRequest(model, candidates, count_params(model), options, layout_choice(model, candidates, options),
                             None, swap_in=None)


def layout_choice(model: nn.Module, candidates, options: ConvertPlan) -> LayoutChoice:
    """How ``options`` lay the candidates out (layouts, modes, gates, rank multiple, codebook tables)."""
    return LayoutChoice(options.layout, options.embedding_layout, options.d, options.gates, options.rank_multiple,
                        codebook_tables(model, candidates, options), options.codebook_width)


def on_device(decompose, device: str):
    """``decompose`` run on ``device``, its cores returned to the matrix's device (--device)."""
    def decompose_there(matrix, spec):
        return [core.to(matrix.device) for core in decompose(matrix.to(device), spec)]

    return decompose_there


def swap_in(model: nn.Module, candidates, specs, options: ConvertPlan, calibration: Calibration | None = None,
            hooks: ModuleHooks = IN_MEMORY) -> None:
    """Replace each candidate that has a spec by its TT module (``_tt_module``) or codebook table
    (fit by k-means to its rows); a None spec leaves it dense. ``hooks`` hear of each module and,
    streaming, bracket it (``hooks.py``)."""
    pairs = ffn_pairs(candidates, specs) if options.ffn == "prune" else {}
    if pairs and calibration is None:
        raise ConfigError("--ffn prune refits each pruned feed-forward pair on calibration text: convert with "
                          "calibration (comera convert calibrates by default)")
    waiting = {}  # down name -> (up candidate, its spec): a pair's up waits for its down
    for index, (candidate, spec) in enumerate(zip(candidates, specs)):
        if spec is None:
            continue
        hooks.progress(candidate.name, index, len(candidates))
        if hooks.streaming:
            hooks.load(candidate.name)
        if candidate.name in pairs:  # up: stays dense until down's inputs are recorded through it
            compensate_up(candidate.module, candidate.name, calibration)
            _round_for_storage(candidate.module, options, candidate.name)  # by row: the kept rows as stored
            waiting[pairs[candidate.name]] = (candidate, spec)
            continue
        if candidate.name in waiting:
            up, up_spec = waiting.pop(candidate.name)
            multiple = kept_multiple(options.rank_multiple, options.dtype, options.group_size)
            kept = kept_neurons(up, up_spec, candidate, spec, multiple)
            for old, new in zip((up, candidate), prune_pair(up.module, candidate.module, kept, candidate.name,
                                                            calibration)):
                _round_for_storage(new, options, old.name)
                _put_in_place(model, old, new, hooks)
            continue
        if isinstance(spec, CodebookSpec):
            new = CodebookEmbedding.from_embedding(candidate.module, spec.subspaces, spec.codewords,
                                                   device=options.device)
            _round_for_storage(new, options, candidate.name)
        else:
            new = _tt_module(candidate, spec, options, calibration)
        _put_in_place(model, candidate, new, hooks)


def _put_in_place(model: nn.Module, candidate, new: nn.Module, hooks: ModuleHooks) -> None:
    """``new`` in the candidate's place; streaming, the dense weights read for it let go and the new
    module handed to ``hooks.release``."""
    set_submodule(model, candidate.name, new)
    if hooks.streaming:  # the dense weight read for this layer is not needed again
        candidate.module.to("meta")
    if hooks.release is not None:
        hooks.release(candidate.name)


def _tt_module(candidate, spec, options: ConvertPlan, calibration: Calibration | None) -> TTModule:
    """The candidate's TT module at ``spec``, decomposed from its weights (by the calibration's
    weighted decomposition when there is one; on ``options.device`` when given)."""
    kwargs = dict(rank=spec.ranks, layout=spec.layout, d=options.d, gates=options.gates)
    decompose = calibration and weighted_decomposer(candidate, calibration, spec.layout)
    if options.device is not None:
        decompose = on_device(decompose or matrix_to_cores, options.device)
    if decompose:
        kwargs["decompose"] = decompose
    if candidate.kind == "embedding":
        order = calibration.token_order(candidate.name) if calibration is not None else None
        table = TTEmbedding.from_embedding(candidate.module, row_modes=spec.row_modes,
                                           col_modes=spec.col_modes, token_order=order, **kwargs)
        _round_for_storage(table, options, candidate.name)
        return table
    new = TTLinear.from_linear(candidate.module, in_modes=spec.row_modes, out_modes=spec.col_modes, **kwargs)
    _round_for_storage(new, options, candidate.name)
    if calibration is not None:
        correct_bias(new, dense_weight_of(candidate.module)[0], candidate.name, calibration)
    return new


def _round_for_storage(module: nn.Module, options: ConvertPlan, name: str) -> None:
    """With integer storage, the new module's factors rounded now (``round_in_place``): the bias
    correction and the layers compensated after it see what the checkpoint will hold."""
    fmt = integer_storage(options.dtype, options.group_size)
    if fmt is not None:
        round_in_place(module, fmt, name)


def _nothing_to_convert(model: nn.Module, skipped: dict) -> str:
    """Why a model has no module to convert: none of a kind the converter knows, or all passed over."""
    if skipped:
        return "no module to convert: every Linear and Embedding was excluded or is too small"
    kinds = sorted({type(m).__name__ for m in model.modules() if not list(m.children())})
    return ("no module to convert: expected Linear, Embedding or GPT-2 Conv1D layers, found only "
            + (", ".join(kinds) or "no layers"))
