"""The README.md model card written into every compressed checkpoint.

What a hub user looks for, in order: the source and its licence, the method, the size (parameters
and bytes), the fidelity per domain (once `comera eval` has run), the commands that made it, how to
load it. The source's own card follows below a marker, so that a further conversion, training run
or `comera decompress` finds it again (``source_card``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..conversion.report import ConversionReport
from .files import write_text_atomic

CARD_FILE = "README.md"
SOURCE_MARKER = "<!-- comera_convert: the source model's card follows -->"
OUR_TAGS = ("comera_convert", "tensor-train", "compressed")
FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*(?:\n|\Z)", re.S)
DOMAIN_COLUMNS = {"mean_cosine": "mean cosine", "min_cosine": "min cosine", "nn_agreement": "NN agreement",
                  "compressed_accuracy": "token accuracy", "reference_accuracy": "dense accuracy",
                  "compressed_perplexity": "perplexity", "reference_perplexity": "dense perplexity"}


@dataclass
class SourceCard:
    """A model card split into its YAML metadata and its markdown body."""
    metadata: dict
    body: str

    @property
    def licence(self) -> str | None:
        value = self.metadata.get("license")
        return str(value) if value else None


def parse_card(text: str) -> SourceCard:
    """Metadata and body of a card; metadata that is not a YAML mapping counts as none."""
    match = FRONT_MATTER.match(text)
    if not match:
        return SourceCard({}, text)
    try:
        metadata = yaml.safe_load(match.group(1)) or {}
    except yaml.YAMLError:
        metadata = {}
    return SourceCard(metadata if isinstance(metadata, dict) else {}, text[match.end():])


def source_card(directory) -> SourceCard | None:
    """The card of the model a checkpoint came from: its README, or, in a comera checkpoint, the
    part below the marker with comera's own tags taken out of the metadata."""
    path = Path(directory) / CARD_FILE if directory is not None else None
    if path is None or not path.is_file():
        return None
    try:
        card = parse_card(path.read_text(errors="replace"))
    except OSError:
        return None
    if SOURCE_MARKER not in card.body:
        return card
    metadata = dict(card.metadata)
    tags = [t for t in metadata.get("tags") or [] if t not in OUR_TAGS]
    metadata.pop("tags", None)
    if tags:
        metadata["tags"] = tags
    return SourceCard(metadata, card.body.split(SOURCE_MARKER, 1)[1].lstrip("\n"))


def _front_matter(source: SourceCard | None, tags=OUR_TAGS) -> str:
    metadata = dict(source.metadata) if source else {}
    metadata.setdefault("library_name", "transformers")
    metadata["tags"] = list(dict.fromkeys([*(metadata.get("tags") or []), *tags]))
    return "---\n" + yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True).strip() + "\n---\n"


def _with_source(text: str, source: SourceCard | None) -> str:
    if source is None or not source.body.strip():
        return text
    return f"{text}\n{SOURCE_MARKER}\n\n{source.body.lstrip()}"


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units, named as such (1 MiB = 1024 KiB = 1,048,576 bytes)."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def method_text(report: ConversionReport) -> str:
    """One sentence: the format, its ranks, how it was initialized and trained."""
    layouts = sorted({row.layout for row in report.modules if row.layout != "-"}) or ["tt"]
    extra = report.extra or {}
    rank = f", shared max rank {report.shared_rank}" if report.shared_rank else ""
    init = (f"TT-SVD whitened by calibration ({extra['calibration']})" if extra.get("calibration")
            else "plain TT-SVD of the weights")
    text = f"CoMERA tensor-train ({'/'.join(layouts)} layout{rank}), initialized by {init}"
    training = extra.get("training")
    if training:
        text += (f"; then trained ({training.get('objective', '?')}, {training.get('steps', '?')} steps, held-out "
                 f"loss {training.get('held_out_loss_before', float('nan')):.4f} -> "
                 f"{training.get('held_out_loss_after', float('nan')):.4f})")
    return text + "."


def facts(report: ConversionReport, disk_bytes: int | None, licence: str | None,
          quote=lambda text: f"`{text}`") -> list[tuple[str, str]]:
    """(label, value) pairs shared by the card and `comera report --compare`; ``quote`` marks names
    and commands (markdown code in the card)."""
    extra = report.extra or {}
    rows = [("source", quote(report.source) if report.source else "unknown"),
            ("licence (of the source)", licence or "not stated in the source's card"),
            ("method", method_text(report)),
            ("parameters", f"{report.params_before:,} -> {report.params_after:,} ({report.ratio:.2f}x smaller, "
                           f"all parameters counted)")]
    if disk_bytes:
        source_bytes = extra.get("source_bytes")
        versus = (f" (source {human_bytes(source_bytes)}, {source_bytes / disk_bytes:.2f}x smaller)"
                  if source_bytes else "")
        rows.append(("weights on disk", human_bytes(disk_bytes) + versus))
    if extra.get("storage_dtype"):
        rows.append(("stored as", extra["storage_dtype"]))
    for command in extra.get("commands") or []:
        rows.append(("made by", quote(command)))
    return rows


def fidelity_text(report: ConversionReport) -> str:
    """The per-domain table `comera eval` recorded, or how to produce it."""
    metrics = (report.extra or {}).get("eval")
    if not metrics:
        return ("Not measured yet: `comera eval <this folder>` compares it with its source on held-out text of "
                "several domains and adds the table here.")
    domains = metrics["domains"]
    keys = [k for k in DOMAIN_COLUMNS if any(k in d for d in domains.values())]
    lines = [f"Against `{metrics['reference']}` on held-out texts (`comera eval`); worst domain: "
             f"**{metrics['worst_domain']}**.", "",
             "| domain | texts | " + " | ".join(DOMAIN_COLUMNS[k] for k in keys) + " |",
             "|---|---:|" + "---:|" * len(keys)]
    for name, values in domains.items():
        cells = " | ".join(f"{values[k]:.3f}" if k in values else "" for k in keys)
        lines.append(f"| {name} | {values['texts']} | {cells} |")
    return "\n".join(lines)


def size_table(report: ConversionReport) -> str:
    """Converted modules, layers of one kind folded into one row."""
    lines = ["| modules | n | layout | shape | ranks | dense params | TT params |", "|---|---:|---|---|---|---:|---:|"]
    groups: dict[str, list] = {}
    for row in report.modules:
        groups.setdefault(row.block, []).append(row)
    for block, rows in groups.items():
        first = rows[0]
        tied = first.kind == "tied_head"  # contracts with its embedding's cores: no parameters of its own
        ranks = "the embedding's" if tied else ", ".join(map(str, first.ranks)) or "-"
        varies = " (varies)" if len({tuple(r.ranks) for r in rows}) > 1 else ""
        layout = "tied" if tied else first.layout
        lines.append(f"| `{block}` | {len(rows)} | {layout} | {first.rows} x {first.cols} | {ranks}{varies} | "
                     f"{sum(r.dense_params for r in rows):,} | {sum(r.tt_params for r in rows):,} |")
    return "\n".join(lines)


def loading_text(sentence_transformers: bool) -> str:
    text = """```python
import comera_convert                       # 1. registers the "comera" loading method
from transformers import AutoModel
model = AutoModel.from_pretrained("path/to/this/folder")

model = comera_convert.from_pretrained("path/to/this/folder")   # 2. the class it was saved from
model = AutoModel.from_pretrained("path/to/this/folder", trust_remote_code=True)  # 3. no import
```
"""
    if sentence_transformers:
        text += """
As a sentence-transformers model (the source's modules, pooling and normalization):

```python
import comera_convert
from sentence_transformers import SentenceTransformer
model = SentenceTransformer("path/to/this/folder")
```
"""
    return text + """
All need `pip install comera-convert`. Without it, transformers stops with an error naming it (it
never loads a dense model with random weights). `comera decompress` writes an ordinary dense
checkpoint."""


def card_text(report: ConversionReport, source: SourceCard | None, disk_bytes: int | None,
              sentence_transformers: bool) -> str:
    title = f"Tensor-train compressed {report.model_class}" + (f" of `{report.source}`" if report.source else "")
    fact_rows = "\n".join(f"| {label} | {value} |" for label, value in
                          facts(report, disk_bytes, source.licence if source else None))
    text = f"""{_front_matter(source)}
# {title}

**{report.ratio:.2f}x smaller** than its source. Written by
[comera_convert](https://pypi.org/project/comera-convert/).

| | |
|---|---|
{fact_rows}

## Fidelity

{fidelity_text(report)}

## Loading

{loading_text(sentence_transformers)}

## Converted modules

{size_table(report)}
"""
    return _with_source(text, source)


def write_model_card(directory: Path, report: ConversionReport, source: SourceCard | None = None,
                     disk_bytes: int | None = None) -> None:
    sentence_transformers = (directory / "modules.json").is_file()
    write_text_atomic(directory / CARD_FILE, card_text(report, source, disk_bytes, sentence_transformers))


def write_dense_card(directory: Path, compressed_from: str, source: SourceCard | None) -> None:
    """The card of a `comera decompress` output: what it is, then the source's card."""
    text = (f"{_front_matter(source, tags=())}\n# Dense expansion of the comera_convert checkpoint "
            f"`{compressed_from}`\n\nAn ordinary transformers checkpoint: the tensor-train layers multiplied "
            f"back into dense weights (the compressed model's function, at the dense size).\n")
    write_text_atomic(directory / CARD_FILE, _with_source(text, source))
