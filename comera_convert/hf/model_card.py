"""The README.md model card written into every compressed checkpoint."""

from __future__ import annotations

from pathlib import Path

from ..conversion.report import ConversionReport


def size_table(report: ConversionReport) -> str:
    lines = ["| module | kind | layout | shape | ranks | dense params | TT params |",
             "|---|---|---|---|---|---|---|"]
    for row in report.modules:
        ranks = ", ".join(map(str, row.ranks)) or "shared"
        lines.append(f"| `{row.name}` | {row.kind} | {row.layout} | {row.rows} x {row.cols} | {ranks} | "
                     f"{row.dense_params:,} | {row.tt_params:,} |")
    return "\n".join(lines)


def write_model_card(directory: Path, report: ConversionReport) -> None:
    source = f" of `{report.source}`" if report.source else ""
    text = f"""---
library_name: transformers
tags: [comera_convert, tensor-train, compressed]
---

# Tensor-train compressed {report.model_class}{source}

{report.params_before:,} -> {report.params_after:,} parameters: **{report.ratio:.2f}x smaller**
(all parameters counted). Written by [comera_convert](https://pypi.org/project/comera-convert/).

```python
import comera_convert                       # registers the loader with transformers
from transformers import AutoModel
model = AutoModel.from_pretrained("path/to/this/folder")
```

or `AutoModel.from_pretrained(path, trust_remote_code=True)` with comera-convert installed.
Without comera_convert, transformers stops with an error naming it (it never loads a dense
model with random weights). `comera decompress` writes an ordinary dense checkpoint.

## Sizes

{size_table(report)}
"""
    (directory / "README.md").write_text(text)
