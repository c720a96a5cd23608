"""Rich tables for reports (the CLI's only presentation code)."""

from __future__ import annotations

from collections import defaultdict

from rich.table import Table


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GB"


def _ranks_text(ranks) -> str:
    return ",".join(map(str, ranks)) if ranks else "shared"


def modules_table(report, by_block: bool = True) -> Table:
    """Per module (or per block type, layer numbers folded) original vs compressed parameters."""
    table = Table(title=f"{report.model_class}: converted modules", title_justify="left")
    table.add_column("module", no_wrap=True)
    for column in ("layout", "shape", "ranks", "n", "dense", "TT", "ratio"):
        table.add_column(column, justify="left" if column in ("layout", "ranks") else "right")
    groups = defaultdict(list)
    for row in report.modules:
        groups[row.block if by_block else row.name].append(row)
    for key, rows in groups.items():
        first = rows[0]
        dense = sum(r.dense_params for r in rows)
        tt = sum(r.tt_params for r in rows)
        ranks = {tuple(r.ranks) for r in rows}
        layout = "tied" if first.kind == "tied_head" else first.layout
        table.add_row(key, layout, f"{first.rows}x{first.cols}",
                      _ranks_text(first.ranks) + ("*" if len(ranks) > 1 else ""), str(len(rows)),
                      f"{dense:,}", f"{tt:,}", f"{dense / tt:.1f}x" if tt else "-")
    table.caption = "ranks: internal bonds of the first module of each row; * = they vary across the row"
    return table


def totals_table(report, disk_bytes: int | None = None) -> Table:
    table = Table(title="totals (all parameters, dense ones included)", title_justify="left")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("parameters before", f"{report.params_before:,}")
    table.add_row("parameters after", f"{report.params_after:,}")
    table.add_row("ratio", f"{report.ratio:.2f}x" + (f" (target {report.target_ratio:g}x)"
                                                     if report.target_ratio else ""))
    if report.shared_rank is not None:
        table.add_row("shared max rank", str(report.shared_rank))
    extra = report.extra or {}
    if "allocation" in extra:
        multiple = f", multiples of {extra['rank_multiple']}" if extra.get("rank_multiple") else ""
        table.add_row("rank allocation", extra["allocation"].split(":")[0] + multiple)
    if "calibration" in extra:
        table.add_row("calibration", extra["calibration"])
    if disk_bytes is not None:
        source = extra.get("source_bytes")
        versus = (f" (source {human_bytes(source)}, {source / disk_bytes:.2f}x smaller)"
                  if source and disk_bytes else "")
        table.add_row("checkpoint on disk", human_bytes(disk_bytes) + versus)
    if "storage_dtype" in extra:
        table.add_row("stored as", extra["storage_dtype"])
    if report.seconds is not None:
        table.add_row("conversion time", f"{report.seconds:.1f} s")
    if "training" in extra:
        table.add_row("training", _training_text(extra["training"]))
    return table


def _training_text(training: dict) -> str:
    """What `comera train` recorded: objective, steps, the held-out loss and the target ratio."""
    text = (f"{training.get('objective', '?')}, {training.get('steps', '?')} steps, held-out loss "
            f"{training.get('held_out_loss_before', float('nan')):.4f} -> "
            f"{training.get('held_out_loss_after', float('nan')):.4f}")
    if training.get("target_ratio") is not None:
        outcome = "reached" if training.get("target_reached") else "missed"
        text += (f"; target ratio {training['target_ratio']:g}x {outcome} "
                 f"({training.get('ratio_reached', float('nan')):.2f}x)")
    return text


def compare_table(infos) -> Table:
    base = infos[0]
    table = Table(title="models side by side", title_justify="left")
    for column, justify in (("model", "left"), ("type", "left"), ("compressed", "left"), ("parameters", "right"),
                            (f"ratio vs {base.name}", "right"), ("on disk", "right"),
                            ("converted modules", "right")):
        table.add_column(column, justify=justify)
    for info in infos:
        modules = str(len(info.report.modules)) if info.report else "-"
        table.add_row(info.name, info.model_type, "yes" if info.compressed else "no", f"{info.params:,}",
                      f"{base.params / max(info.params, 1):.2f}x", human_bytes(info.disk_bytes), modules)
    return table


EVAL_COLUMNS = {  # metric key -> column title, in the order shown
    "mean_cosine": "mean cos", "min_cosine": "min cos", "nn_agreement": "NN agree",
    "compressed_loss": "loss", "reference_loss": "dense loss", "compressed_accuracy": "acc",
    "reference_accuracy": "dense acc", "compressed_perplexity": "ppl", "reference_perplexity": "dense ppl",
}


def eval_table(name: str, metrics: dict) -> Table:
    """One row per evaluated domain, the worst one marked."""
    domains = metrics["domains"]
    keys = [k for k in EVAL_COLUMNS if any(k in m for m in domains.values())]
    table = Table(title=f"{name} vs {metrics['reference']} (held-out texts)", title_justify="left")
    table.add_column("domain")
    table.add_column("texts", justify="right")
    for key in keys:
        table.add_column(EVAL_COLUMNS[key], justify="right")
    for domain, values in domains.items():
        label = f"{domain} [red](worst)[/]" if domain == metrics["worst_domain"] and len(domains) > 1 else domain
        table.add_row(label, str(values["texts"]), *(f"{values[k]:.4f}" if k in values else "" for k in keys))
    return table
