"""Factorize: the converter's module loop over a model (``conversion/converter.py``: low-rank/TT, codebook or
pruning chosen by dispatch on each layer, rounded for integer storage), then what makes the result save and load
as a compressed transformers model. ``comera_convert.convert`` calls it on a model in memory; the stage runner
(``runner.py``) calls it between the stages' preparing and finishing, with their module steps as its hooks."""

from __future__ import annotations

from torch import nn

from ..conversion import Calibration, ConversionReport, ConvertPlan, convert_modules
from ..conversion.hooks import IN_MEMORY, ModuleHooks
from ..conversion.plan import finite_cut
from ..conversion.storage import integer_storage, round_in_place, storage_record
from ..hf.compat import untie_converted_heads
from ..hf.config import ComeraConfig


def convert_model(model: nn.Module, options: ConvertPlan, *, calibration: Calibration | None = None,
                  source: str | None = None, hooks: ModuleHooks = IN_MEMORY) -> ConversionReport:
    """Convert ``model`` in place as ``options`` (the request's plan for it) say (``comera_convert.convert``
    is the public verb): the in-place swap (``conversion``), the heads untied from converted tables, integer
    rounding of what is left dense, and the marks that make it save and load as a compressed model.
    ``hooks``: who hears of each module and, streaming, hands its weights in and takes it out."""
    report = convert_modules(model, options, calibration=calibration, hooks=hooks, source=source)
    report.extra["plan"] = options.describe()
    if finite_cut(options) is not None:
        report.extra["layers_cut"] = finite_cut(options)
    untie_converted_heads(model)
    fmt = integer_storage(options.dtype, options.group_size)
    if fmt is not None:  # the layers left dense too: in memory the model is what its checkpoint holds
        round_in_place(model, fmt)
    storage = storage_record(options.dtype, options.group_size) if fmt is not None else None
    # Imported here: importing it loads transformers' quantizers, whose loading registers the "comera" method
    # from this very module (hf/registration.py), so it must not load while this module does.
    from ..hf.quantizer import mark_converted

    mark_converted(model, ComeraConfig(source=source, dense_params=report.params_before, storage=storage))
    return report
