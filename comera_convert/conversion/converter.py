"""convert(): swap a model's Linear / Conv1D / Embedding modules for TT modules, in place.

    import comera_convert
    report = comera_convert.convert(model, ratio=4)   # the whole model 4x smaller
    print(report.summary())

The model keeps its class, its forward and its config (which gains a ``quantization_config``
describing the compression), so ``save_pretrained`` writes a compressed checkpoint and
transformers loads it back once ``comera_convert`` is imported.
"""

from __future__ import annotations

import time
from typing import Callable

from torch import nn

from ..errors import ConfigError
from ..hf.config import ComeraConfig
from ..layers import TTEmbedding, TTLinear, TTModule
from ..layers.tt_linear import dense_weight_of
from .allocate import LayoutChoice, allocate_ranks
from .calibration import Calibration, correct_bias, weighted_decomposer
from .measured import allocate_measured
from .options import ConvertOptions
from .records import tie_head, untie_converted_heads
from .report import ConversionReport, describe
from .sensitivity import allocate_by_sensitivity
from .targets import find_candidates


def count_params(model: nn.Module) -> int:
    """Parameters of the model, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters())


def convert(model: nn.Module, ratio: float | None = 4.0, layout: str = "tt", targets=None, exclude=None, *,
            rank: int | None = None, embedding_layout: str = "tt", d: int = 3, gates: bool = True,
            source: str | None = None, progress: Callable[[str, int, int], None] | None = None,
            calibration: Calibration | None = None, allocation: str = "uniform",
            rank_multiple: int = 1, embedding_rank_scale: float = 1.5) -> ConversionReport:
    """Convert ``model`` in place; returns the report of what was compressed.

    ratio: the whole model (dense parameters included) shrinks at least this many times; ranks
        are allocated to meet it. Ignored when ``rank`` is given.
    rank: a fixed maximum rank for every converted layer instead of a ratio.
    layout / embedding_layout: "tt" or "ttm" for linear layers / embeddings (both tt by default;
        CoMERA lays embeddings out ttm).
    targets / exclude: module-name patterns (globs, or one dot-separated name part).
    progress: called as progress(module name, index, count) before each module is converted.
    calibration: ``calibrate(model, tokenizer, data)``: each layer's decomposition then minimizes
        its error on those inputs (activation-aware TT-SVD; token-frequency-weighted embeddings).
    allocation: "uniform" (one shared maximum rank), "measured" (per-kind rank scales searched on
        the calibration sequences end to end) or "sensitivity" (per-layer ranks from the
        calibration's error estimates).
    rank_multiple: the ranks a ratio chooses are multiples of this (8: faster bf16 GEMMs on GPUs).
    embedding_rank_scale: the input embedding's ranks relative to the shared rank (uniform allocation).
    """
    options = ConvertOptions(ratio=None if rank is not None else ratio, rank=rank, layout=layout,
                             embedding_layout=embedding_layout, d=d, targets=targets, exclude=exclude,
                             gates=gates, allocation=allocation, rank_multiple=rank_multiple,
                             embedding_rank_scale=embedding_rank_scale,
                             calibration=(calibration.source or "given") if calibration is not None else None)
    return convert_with(model, options, source=source, progress=progress, calibration=calibration)


def convert_with(model: nn.Module, options: ConvertOptions, source: str | None = None,
                 progress: Callable[[str, int, int], None] | None = None,
                 calibration: Calibration | None = None) -> ConversionReport:
    """``convert`` driven by a validated ConvertOptions (what recipes load into). With
    ``calibration`` (``calibrate()``), each layer's decomposition minimizes its error on the
    calibration inputs instead of its weight error."""
    if options.calibration is not None and calibration is None:
        raise ConfigError(f"calibration {options.calibration!r} was asked for but no statistics were given: "
                          f"pass calibration=calibrate(model, tokenizer, {options.calibration!r})")
    if any(isinstance(m, TTModule) for m in model.modules()):
        raise ConfigError("the model is already compressed: convert the dense model, "
                          "or retrain this one with `comera train`")
    start = time.perf_counter()
    params_before = count_params(model)
    candidates, tied, skipped = find_candidates(model, options.targets, options.exclude, options.d)
    if not candidates:
        raise ConfigError("no module to convert: every Linear and Embedding was excluded or is too small")
    choice = LayoutChoice(options.layout, options.embedding_layout, options.d, options.gates, options.rank_multiple)
    extra = {"allocation": "uniform: one shared maximum rank"}
    if options.rank_multiple != 1:
        extra["rank_multiple"] = options.rank_multiple
    if calibration is not None:
        extra["calibration"] = calibration.describe()
    if options.rank is not None:
        # An explicit rank is honoured even where TT is not smaller (full-rank round trips, studies).
        specs, shared_rank = [choice.spec(c, options.rank) for c in candidates], options.rank
    elif options.allocation == "sensitivity":
        specs, estimated = allocate_by_sensitivity(candidates, params_before, options.ratio, choice, calibration)
        shared_rank = None
        extra.update(allocation="sensitivity: per-layer ranks, greedy by estimated output error removed per "
                                "parameter on the calibration inputs",
                     estimated_relative_error={k: round(v, 4) for k, v in estimated.items()})
    elif options.allocation == "measured":
        if calibration.probe is None:
            raise ConfigError("allocation 'measured' needs probe sequences in the calibration: build it with "
                              "calibrate() or collect()")
        specs, scales, cosine = allocate_measured(
            model, candidates, params_before, options.ratio, choice, calibration,
            lambda clone, clone_candidates, trial: swap_in(clone, clone_candidates, trial, options, calibration),
            progress)
        shared_rank = None
        extra.update(allocation="measured: per-kind rank scales searched end to end on the calibration "
                                "sequences",
                     rank_scales={kind: round(scale, 3) for kind, scale in scales.items()},
                     probe_cosine=round(cosine, 4))
    else:
        specs, shared_rank = allocate_ranks(candidates, params_before, options.ratio, choice,
                                            _embedding_scale(model, options.embedding_rank_scale))

    for candidate, spec in zip(candidates, specs):
        if spec is None:
            skipped[candidate.name] = (f"TT at rank {shared_rank} would not be smaller" if shared_rank else
                                       f"kept dense by the {options.allocation} allocation")
    swap_in(model, candidates, specs, options, calibration, progress)

    converted = {c.name for c, s in zip(candidates, specs) if s is not None}
    for head in tied:
        if head.embedding_name not in converted:
            skipped[head.name] = f"tied to the dense {head.embedding_name}"
            continue
        tie_head(model, head.name, {"embedding": head.embedding_name,
                                    "bias": getattr(head.module, "bias", None) is not None})
    untie_converted_heads(model)
    mark_compressed(model, ComeraConfig(source=source, dense_params=params_before))
    report = describe(model, skipped=skipped, target_ratio=options.ratio, shared_rank=shared_rank,
                      seconds=time.perf_counter() - start, params_before=params_before)
    report.extra.update(extra)
    return report


def _embedding_scale(model: nn.Module, scale: float):
    """The uniform allocation's per-layer rank scale: ``scale`` for the input embedding, 1 elsewhere
    (None when there is nothing to scale)."""
    get = getattr(model, "get_input_embeddings", None)
    words = get() if get is not None else None
    if words is None or scale == 1:
        return None
    return lambda candidate: scale if candidate.module is words else 1.0


def swap_in(model: nn.Module, candidates, specs, options: ConvertOptions, calibration: Calibration | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> None:
    """Replace each candidate that has a spec by its TT module, decomposed from its weights (by the
    calibration's weighted decomposition when there is one); a None spec leaves it dense."""
    for index, (candidate, spec) in enumerate(zip(candidates, specs)):
        if spec is None:
            continue
        if progress is not None:
            progress(candidate.name, index, len(candidates))
        kwargs = dict(rank=spec.ranks, layout=spec.layout, d=options.d, gates=options.gates)
        decompose = calibration and weighted_decomposer(candidate, calibration, spec.layout)
        if decompose:
            kwargs["decompose"] = decompose
        if candidate.kind == "embedding":
            order = calibration.token_order(candidate.name) if calibration is not None else None
            new = TTEmbedding.from_embedding(candidate.module, row_modes=spec.row_modes,
                                             col_modes=spec.col_modes, token_order=order, **kwargs)
        else:
            new = TTLinear.from_linear(candidate.module, in_modes=spec.row_modes, out_modes=spec.col_modes,
                                       **kwargs)
            if calibration is not None:
                correct_bias(new, dense_weight_of(candidate.module)[0], candidate.name, calibration)
        model.set_submodule(candidate.name, new)


def mark_compressed(model: nn.Module, quantization_config: ComeraConfig) -> None:
    """Make a converted model look and save like a loaded compressed model: its config records the
    compression (following the live modules) and ``save_pretrained`` writes compressed checkpoints."""
    from ..hf.quantizer import ComeraQuantizer
    from ..hf.saving import install_save_hook

    quantization_config.attach(model)
    install_save_hook(model)
    config = getattr(model, "config", None)
    if config is None:
        return  # a plain nn.Module: nothing more to record
    config.quantization_config = quantization_config
    model.hf_quantizer = ComeraQuantizer(quantization_config, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = quantization_config.quant_method
