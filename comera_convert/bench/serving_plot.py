"""The serving frontier as a plot: each method's speed against the fastest route that needs no comera (the
``speed_vs_peer`` of ``serving.serving_case``'s rows) beside the share of dense recall@1 it keeps on its worst
domain, each with its standard error. The routes with no comera are grey squares; the compressed checkpoints'
methods are coloured by runtime and named after their checkpoint. A point right of the dashed line runs faster
than that route; one above the dotted line keeps at least what it keeps: beyond the peer on both axes is the
upper right."""

from __future__ import annotations

from pathlib import Path

from ..hf.files import save_figure_atomic
from .serving import zero_effort

RUNTIME_COLOURS = {"OpenVINO": "tab:blue", "ONNX Runtime": "tab:orange", "torch": "tab:green"}


def runtime_of(method: str) -> str:
    for runtime in ("OpenVINO", "ONNX Runtime"):
        if runtime in method:
            return runtime
    return "torch"


def plot_serving(rows: list[dict], path: Path, machine: str) -> Path:
    """Write the frontier of ``rows`` (one serving case's) to ``path`` (a PNG), atomically."""
    from matplotlib.figure import Figure

    rows = [row for row in rows if "speed_vs_peer" in row and row["method"] != "dense"]
    routes = set(zero_effort([row["method"] for row in rows]))
    peer = next((row for row in rows if row["method"] == row["peer"]), None)
    fig = Figure(figsize=(9, 6), dpi=100)
    axis = fig.subplots()
    for row in rows:
        is_route = row["method"] in routes
        colour = "tab:gray" if is_route else RUNTIME_COLOURS[runtime_of(row["method"])]
        axis.errorbar(row["speed_vs_peer"], row["worst_kept"], xerr=row.get("speed_vs_peer_error"),
                      yerr=row.get("worst_kept_error"), fmt="s" if is_route else "o", color=colour, capsize=2,
                      markersize=5)
        label = row["method"] if is_route else f"{row.get('checkpoint') or 'comera'}: {_short(row['method'])}"
        axis.annotate(label, (row["speed_vs_peer"], row["worst_kept"]), fontsize=6, xytext=(3, 3),
                      textcoords="offset points")
    axis.axvline(1.0, color="gray", linestyle="--", linewidth=0.8)
    if peer is not None:
        axis.axhline(peer["worst_kept"], color="gray", linestyle=":", linewidth=0.8)
    for runtime, colour in RUNTIME_COLOURS.items():
        axis.plot([], [], "o", color=colour, label=f"comera, {runtime}")
    axis.plot([], [], "s", color="tab:gray", label="no comera (sentence-transformers' routes)")
    axis.legend(loc="lower left", fontsize=8)
    axis.set_xlabel(f"speed against the fastest route with no comera ({peer['method'] if peer else 'none'})")
    axis.set_ylabel("share of dense recall@1 kept, worst domain")
    axis.grid(True, linewidth=0.3)
    shape = rows[0]["shape"] if rows else ""
    fig.suptitle(f"serving frontier: {shape}\n{machine}", fontsize=9)
    fig.tight_layout()
    return save_figure_atomic(fig, path)


def _short(method: str) -> str:
    """A compressed method's name without "comera" and its checkpoint label."""
    return method.split(" [")[0].removeprefix("comera, ").removeprefix("comera ")
