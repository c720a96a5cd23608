"""The training curve: task loss and model ratio over steps, as a PNG beside the checkpoint."""

from __future__ import annotations

from pathlib import Path

from ..hf.files import save_figure_atomic


def plot_history(history: list[dict], path: Path) -> Path | None:
    rows = [h for h in history if h.get("loss") is not None]
    if not rows:
        return None
    # A Figure of its own (no pyplot): the user's matplotlib backend and open figures stay as they were.
    from matplotlib.figure import Figure

    steps = [h["step"] for h in rows]
    fig = Figure(figsize=(7, 4), dpi=100)
    loss_axis = fig.subplots()
    loss_axis.plot(steps, [h["loss"] for h in rows], color="tab:blue", label="task loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("task loss", color="tab:blue")
    ratio_axis = loss_axis.twinx()
    ratio_axis.plot(steps, [h["ratio"] for h in rows], color="tab:red", label="model ratio")
    ratio_axis.set_ylabel("compression ratio vs dense", color="tab:red")
    budget = [(h["step"], h["budget_ratio"]) for h in rows if h.get("budget_ratio") is not None]
    if budget:
        ratio_axis.plot(*zip(*budget), color="tab:red", linestyle=":", linewidth=1, label="budget")
    target = rows[-1].get("target_ratio")
    if target is not None:
        ratio_axis.axhline(target, color="tab:red", linestyle="--", linewidth=1)
        ratio_axis.text(steps[0], target, f" target {target:g}x", va="bottom", fontsize=8, color="tab:red")
    late = [h["step"] for h in rows if h.get("stage") == "late"]
    if late:
        loss_axis.axvline(late[0], color="gray", linestyle="--", linewidth=1)
        loss_axis.text(late[0], loss_axis.get_ylim()[1], " late stage", va="top", fontsize=8, color="gray")
    fig.suptitle("comera train: loss and compression")
    fig.tight_layout()
    return save_figure_atomic(fig, path)
