"""ConversionReport: what was compressed and by how much (returned by ``convert``, saved with
the checkpoint as ``comera_report.json``, printed by ``comera report``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..errors import ModelLoadError
from ..layers import CodebookEmbedding, PrunedLinear, TiedTTHead, TTModule
from .model_facts import count_params

REPORT_FILE = "comera_report.json"
# What stays true of a checkpoint after more training: how it was made and from what. Measurements
# of the model as it was (`comera eval`'s figures, timings, an earlier training record) do not.
LINEAGE_KEYS = ("calibration", "allocation", "rank_multiple", "layers_cut", "reconstruction", "storage_dtype",
                "source_bytes", "commands")


def fold_layer_numbers(name: str) -> str:
    """The module name with layer numbers folded (encoder.layer.*.attention.self.query): what the
    layers of one kind share."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


@dataclass
class ModuleRow:
    name: str
    kind: str  # linear, embedding, tied_head
    layout: str
    rows: int
    cols: int
    ranks: list[int]
    dense_params: int
    tt_params: int

    @property
    def ratio(self) -> float:
        return self.dense_params / max(self.tt_params, 1)

    @property
    def block(self) -> str:
        return fold_layer_numbers(self.name)


@dataclass
class ConversionReport:
    """What a conversion did: parameters before and after, each converted module's layout and ranks, what stayed
    dense and why, and the conversion's extra facts (calibration, allocation, errors before and after
    reconstruction)."""

    model_class: str
    params_before: int
    params_after: int
    modules: list[ModuleRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    target_ratio: float | None = None
    shared_rank: int | None = None
    seconds: float | None = None
    source: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """The whole model's compression: parameters before / after, dense ones included."""
        return self.params_before / max(self.params_after, 1)

    def to_dict(self) -> dict:
        """The report as plain data (``comera_report.json``)."""
        data = asdict(self)
        data["ratio"] = self.ratio
        return data

    def to_json(self) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "ConversionReport":
        """A report read back from ``to_dict``'s data."""
        data = dict(data)
        data.pop("ratio", None)
        data["modules"] = [ModuleRow(**row) for row in data.get("modules", [])]
        return cls(**data)

    def summary(self) -> str:
        """A few lines for a person: the ratio reached, parameters before and after, modules converted."""
        return (f"{self.model_class}: {self.params_before:,} -> {self.params_after:,} parameters "
                f"({self.ratio:.2f}x smaller), {len(self.modules)} modules converted")


def read_report(directory) -> ConversionReport | None:
    """The comera_report.json of a checkpoint directory, None where there is none; a file that is
    not a report is a one-line error."""
    from pathlib import Path

    path = Path(directory) / REPORT_FILE
    if not path.is_file():
        return None
    try:
        return ConversionReport.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as err:
        raise ModelLoadError(f"{path} is not a valid report: {err}") from None


def lineage(previous: ConversionReport | None, command: str | None = None) -> dict:
    """The ``extra`` a new checkpoint inherits from the one it was made from, plus ``command``
    appended to the commands that made it."""
    extra = {k: v for k, v in (previous.extra if previous else {}).items() if k in LINEAGE_KEYS}
    if command:
        extra["commands"] = [*extra.get("commands", []), command]
    return extra


def describe(model, **fields) -> ConversionReport:
    """A report of a converted model as it is now: its live modules and current ranks.

    The dense parameter count comes from the model's compression record; ``fields`` fill the
    rest (skipped modules, timing, target ratio) where the caller knows them.
    """
    rows = []
    for name, module in model.named_modules():
        if isinstance(module, TTModule):
            spec = module.spec
            own = sum(p.numel() for n, p in module.named_parameters() if n != "bias")
            kind = "embedding" if hasattr(module, "num_embeddings") else "linear"
            rows.append(ModuleRow(name, kind, spec.layout, spec.rows, spec.cols, list(module.ranks),
                                  spec.rows * spec.cols, own))
        elif isinstance(module, CodebookEmbedding):
            spec = module.spec
            rows.append(ModuleRow(name, "embedding", spec.layout, spec.rows, spec.cols, [],  # no bonds
                                  spec.rows * spec.cols, module.stored_params()))
        elif isinstance(module, PrunedLinear):  # its "rank": the hidden neurons kept
            rows_in, cols_out = ((module.in_features, module.dense_features) if module.pruned == "out"
                                 else (module.dense_features, module.out_features))
            rows.append(ModuleRow(name, "linear", "pruned", rows_in, cols_out, [module.kept],
                                  rows_in * cols_out, module.weight.numel()))
        elif isinstance(module, TiedTTHead):
            rows.append(ModuleRow(name, "tied_head", "-", module.in_features, module.out_features, [], 0, 0))
    quantization_config = getattr(getattr(model, "config", None), "quantization_config", None)
    params_after = count_params(model)
    defaults = dict(source=getattr(quantization_config, "source", None),
                    params_before=getattr(quantization_config, "dense_params", None) or params_after)
    return ConversionReport(model_class=type(model).__name__, params_after=params_after, modules=rows,
                            **{**defaults, **fields})
