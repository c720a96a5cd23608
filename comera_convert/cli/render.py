"""Rich renderings of reports (the CLI's only presentation code).

Every table reads at any width: where its natural width fits the console it is a table; where it
does not (an 80-column terminal, a pipe, a log file) each row becomes a record, its first cell on
a line of its own and the others as ``name=value`` pairs wrapped below it, so that no cell is
ever cut to "…".
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ..hf.model_card import facts, human_bytes

WIDE = 100_000  # a console this wide measures a table's natural (unwrapped) width


def natural_width(renderable) -> int:
    probe = Console(width=WIDE)
    return Measurement.get(probe, probe.options, renderable).maximum


def fitted(title: str, columns: list[tuple[str, str]], rows: list[list[str]], width: int,
           caption: str | None = None) -> RenderableType:
    """``rows`` under ``columns`` ((name, justify) pairs) as a table when it fits ``width``, else as
    records."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, caption=caption, caption_justify="left")
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    if natural_width(table) <= width:
        return table
    parts: list[RenderableType] = [Text(title, style="table.title")]
    for row in rows:
        parts.append(Text(row[0], style="bold", overflow="fold"))
        pairs = "  ".join(f"{name}={value}" for (name, _), value in zip(columns[1:], row[1:]) if value)
        parts.append(Padding(Text(pairs, overflow="fold"), (0, 0, 0, 2), expand=False))
    if caption:
        parts.append(Text(caption, style="dim"))
    return Group(*parts, Text(""))


def _ranks_text(ranks, layout: str = "tt") -> str:
    if layout == "codebook":  # codes and centres: no bonds
        return "-"
    return ",".join(map(str, ranks)) if ranks else "shared"


def modules_table(report, width: int, by_block: bool = True) -> RenderableType:
    """Per module (or per block type, layer numbers folded) original vs compressed parameters."""
    groups = defaultdict(list)
    for row in report.modules:
        groups[row.block if by_block else row.name].append(row)
    rows = []
    for key, members in groups.items():
        first = members[0]
        dense = sum(r.dense_params for r in members)
        tt = sum(r.tt_params for r in members)
        tied = first.kind == "tied_head"
        varies = "*" if len({tuple(r.ranks) for r in members}) > 1 else ""
        rows.append([key, "tied" if tied else first.layout, f"{first.rows}x{first.cols}",
                     "embedding's" if tied else _ranks_text(first.ranks, first.layout) + varies, str(len(members)),
                     f"{dense:,}", f"{tt:,}", f"{dense / tt:.1f}x" if tt else "-"])
    columns = [("module", "left"), ("layout", "left"), ("shape", "right"), ("ranks", "left"), ("n", "right"),
               ("dense", "right"), ("TT", "right"), ("ratio", "right")]
    caption = "ranks: internal bonds of the first module of each row; * = they vary across the row"
    if any(row.layout == "pruned" for row in report.modules):
        caption += "; a pruned layer's: the hidden neurons it keeps"
    return fitted(f"{report.model_class}: converted modules", columns, rows, width, caption=caption)


def totals_table(report, disk_bytes: int | None = None) -> Table:
    """Two columns, the values folded where they are long: fits any width."""
    table = Table(title="totals (all parameters, dense ones included)", title_justify="left", box=box.SIMPLE_HEAD,
                  show_header=False)
    table.add_column("", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_row("parameters before", f"{report.params_before:,}")
    table.add_row("parameters after", f"{report.params_after:,}")
    table.add_row("ratio", f"{report.ratio:.2f}x" + (f" (target {report.target_ratio:g}x)"
                                                     if report.target_ratio else ""))
    if report.shared_rank is not None:
        table.add_row("shared max rank", str(report.shared_rank))
    extra = report.extra or {}
    if "allocation" in extra:
        multiple = f", multiples of {extra['rank_multiple']}" if extra.get("rank_multiple") else ""
        last_block = (f", the last block at {extra['last_block_rank_scale']:g}x"
                      if extra.get("last_block_rank_scale") else "")
        kept = ", its attention output dense" if extra.get("dense_last_attention_output") else ""
        table.add_row("rank allocation", extra["allocation"].split(":")[0] + last_block + kept + multiple)
    if extra.get("learned_distance"):
        before, after = extra["learned_distance"]
        table.add_row("learned allocation", f"held-out distance to the dense outputs {before:.3f} -> {after:.3f} "
                                            f"({extra['learning_steps']} steps, {extra['learning_seconds']:.0f} s)")
    if extra.get("layers_cut"):
        table.add_row("factorized layers cut", f"{extra['layers_cut']:.2f}x")
    if "calibration" in extra:
        table.add_row("calibration", extra["calibration"])
    if extra.get("reconstruction"):
        table.add_row("block reconstruction", reconstruction_text(extra["reconstruction"]))
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
    outcome = "reached" if training.get("target_reached") else "missed"
    if training.get("target_ratio") is not None:
        text += (f"; target ratio {training['target_ratio']:g}x {outcome} "
                 f"({training.get('ratio_reached', float('nan')):.2f}x)")
    if training.get("target_speedup") is not None:
        reached = training.get("speed_reached") or {}
        text += (f"; target speedup {training['target_speedup']:g}x in {reached.get('runtime', '?')} {outcome} "
                 f"({reached.get('speedup', float('nan')):.2f}x measured, ratio "
                 f"{training.get('ratio_reached', float('nan')):.2f}x)")
    return text


def peers_table(model: str, metrics: dict, width: int) -> RenderableType:
    """The compressed model and every peer in one table: bytes, how many times fewer than the dense
    model's, and per domain the share of dense recall@1 kept with its standard error (the mean cosine
    to the dense model where retrieval was not scored)."""
    sizes = metrics["sizes"]
    dense_bytes = sizes["dense"]["bytes"]
    entries = [(model, metrics["domains"], sizes["compressed"])]
    entries += [(label, domains, sizes.get(label)) for label, domains in metrics["baselines"].items()]
    names = list(metrics["domains"])
    measure = "recall_kept" if any("recall_kept" in m for m in metrics["domains"].values()) else "mean_cosine"
    columns = [("model", "left"), ("bytes", "right"), ("fewer", "right")] + [(name, "right") for name in names]
    rows = []
    for label, domains, size in entries:
        stored = size["bytes"] if size else None
        rows.append([label, human_bytes(stored) if stored else "-", f"{dense_bytes / stored:.1f}x" if stored else "-",
                     *(_kept_text(domains.get(n, {}), measure) for n in names)])
    what = "share of dense recall@1 kept" if measure == "recall_kept" else "mean cosine to the dense model"
    return fitted(f"against the peers: {what}, bytes against the dense model's {human_bytes(dense_bytes)}",
                  columns, rows, width)


def _kept_text(metrics: dict, measure: str) -> str:
    """``metrics[measure]`` to three places, with the share's standard error where it was measured."""
    if measure not in metrics:
        return ""
    error = metrics.get("recall_kept_error") if measure == "recall_kept" else None
    return f"{metrics[measure]:.3f}" + (f" ± {error:.3f}" if error is not None else "")


def frontier_table(frontier: dict, width: int) -> RenderableType:
    """Every model of the frontier by bytes, largest first: how many times fewer bytes than the dense
    model, and the share of dense recall@1 kept per domain and on average, with the mean's standard
    error."""
    dense = frontier["dense_bytes"]
    columns = ([("model", "left"), ("bytes", "right"), ("fewer", "right")]
               + [(name, "right") for name in frontier["domains"]]
               + [("mean", "right"), ("± mean", "right")])
    rows = [[p["label"] + (" (peer)" if p["kind"] == "peer" else ""), human_bytes(p["bytes"]),
             f"{dense / p['bytes']:.1f}x", *(f"{p['kept'][name]:.3f}" for name in frontier["domains"]),
             f"{p['mean_kept']:.3f}", f"{p['mean_kept_error']:.3f}"] for p in frontier["points"]]
    return fitted(f"size frontier of {frontier['reference']}: share of dense recall@1 kept "
                  f"(dense {human_bytes(dense)})", columns, rows, width)


def reconstruction_text(fits: list[dict]) -> str:
    """Each block's held-out distance from the dense outputs before and after reconstruction, and how
    many kept it."""
    kept = sum(fit["kept"] for fit in fits)
    errors = ", ".join(f"{fit['error_before']:.3f}->{fit['error_after']:.3f}" for fit in fits)
    steps = f", {fits[0]['steps']} steps each" if "steps" in fits[0] else ""  # older reports lack it
    rates = [fit["lr"] for fit in fits if "lr" in fit]
    if rates:  # where the rate was rejected, blocks were tuned at a lower one
        lower = [rate for rate in rates if rate < max(rates)]
        steps += f" at {max(rates):g}" + (f", {len(lower)} at {min(rates):g}" if lower else "")
    return (f"held-out cosine distance to the dense outputs per block {errors} "
            f"({kept} of {len(fits)} blocks tuned{steps})")


def compare_table(infos, width: int) -> Table:
    """The models side by side, one column each: sizes, then what the model card states (source,
    licence, method, fidelity per domain, the commands that made it)."""
    base = infos[0]
    table = Table(title="models side by side", title_justify="left", box=box.SIMPLE_HEAD, width=width)
    table.add_column("", no_wrap=True)
    for info in infos:  # the folder's own name heads the column; the full path is a row
        table.add_column(Path(info.name.rstrip("/")).name or info.name, overflow="fold")
    rows = {"model": [i.name for i in infos], "type": [i.model_type for i in infos],
            "compressed": ["yes" if i.compressed else "no" for i in infos],
            "parameters": [f"{i.params:,}" for i in infos],
            f"ratio vs {Path(base.name.rstrip('/')).name or base.name}": [f"{base.params / max(i.params, 1):.2f}x"
                                                                          for i in infos],
            "on disk": [human_bytes(i.disk_bytes) for i in infos],
            "smaller on disk": [f"{base.disk_bytes / max(i.disk_bytes, 1):.2f}x" for i in infos],
            "converted modules": [str(len(i.report.modules)) if i.report else "-" for i in infos]}
    card_facts = [dict(facts(i.report, None, i.licence, quote=str)) if i.report else {"licence (of the source)":
                  i.licence or "not stated"} for i in infos]
    for label in ("source", "licence (of the source)", "method", "stored as"):
        rows[label.replace(" (of the source)", "")] = [f.get(label, "-") for f in card_facts]
    rows.update(_fidelity_rows(infos))
    rows["made by"] = [" ; ".join((i.report.extra or {}).get("commands", [])) or "-" if i.report else "-"
                       for i in infos]
    for label, values in rows.items():
        table.add_row(label, *values)
    return table


def _fidelity_rows(infos) -> dict[str, list[str]]:
    """One row per domain `comera eval` measured on any of the models: mean cosine (or perplexity)."""
    evals = [(i.report.extra or {}).get("eval") if i.report else None for i in infos]
    domains = list(dict.fromkeys(d for e in evals if e for d in e["domains"]))
    rows = {}
    for domain in domains:
        cells = []
        for metrics in evals:
            values = (metrics or {}).get("domains", {}).get(domain)
            if not values:
                cells.append("-")
            elif "mean_cosine" in values:
                cells.append(f"cosine {values['mean_cosine']:.3f}")
            else:
                cells.append(f"ppl {values['compressed_perplexity']:.2f} (dense {values['reference_perplexity']:.2f})")
        rows[f"fidelity: {domain}"] = cells
    return rows


def plan_table(report, width: int) -> RenderableType | None:
    """The conversion's plan: each option the request left open, what was chosen and why (None for a
    checkpoint whose report records no plan)."""
    planned = (report.extra or {}).get("plan")
    if not planned:
        return None
    rows = [[name, _plain(choice["value"]), choice["reason"]] for name, choice in planned.items()]
    return fitted("plan: the options derived for this model", [("option", "left"), ("chosen", "right"),
                                                               ("why", "left")], rows, width)


def _plain(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)  # None: not chosen, or a cut out of reach (plan.describe)


EVAL_COLUMNS = {  # metric key -> column title, in the order shown
    "mean_cosine": "mean cos", "min_cosine": "min cos", "nn_agreement": "NN agree",
    "recall_at_1": "R@1", "dense_recall_at_1": "dense R@1", "recall_kept": "R@1 kept",
    "recall_kept_error": "± kept", "mrr": "MRR",
    "compressed_loss": "loss", "reference_loss": "dense loss", "compressed_accuracy": "acc",
    "reference_accuracy": "dense acc", "compressed_perplexity": "ppl", "reference_perplexity": "dense ppl",
}


def eval_table(name: str, metrics: dict, width: int) -> RenderableType:
    """One row per evaluated domain, the worst one marked."""
    domains = metrics["domains"]
    keys = [k for k in EVAL_COLUMNS if any(k in m for m in domains.values())]
    columns = [("domain", "left"), ("texts", "right")] + [(EVAL_COLUMNS[k], "right") for k in keys]
    rows = []
    for domain, values in domains.items():
        worst = " (worst)" if domain == metrics["worst_domain"] and len(domains) > 1 else ""
        rows.append([domain + worst, str(values["texts"]), *(f"{values[k]:.4f}" if k in values else "" for k in keys)])
    return fitted(f"{name} vs {metrics['reference']} (held-out texts)", columns, rows, width)
