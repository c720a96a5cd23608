"""The size frontier (`comera frontier`): how much of the dense model's retrieval each way of making
it smaller keeps, against the bytes it stores.

Compressed checkpoints of one source (as many as given: ratios, storage dtypes, trained or not) and
the peers of that source (``peers.py``: rounding every weight to 16, 8, 4, 3 and 2 bits; Model2Vec
at each checkpoint's bytes where model2vec's distillation is installed) are scored on the same
query/document pairs, the dense model's embeddings computed once: the share of its recall@1 each
keeps per domain with its standard error, and their mean. A plot puts the mean against the bytes,
on a log scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError
from .evaluation import DEFAULT_DOMAINS, MODEL2VEC_MISSING, Task, _kind, domain_pairs, static_baseline, static_dims
from .hf.config import compression_of
from .hf.files import save_figure_atomic
from .hf.loading import from_pretrained
from .hf.saving import weight_bytes
from .models import load_model, load_tokenizer, read_config, resolve
from .peers import float_bytes, rounding_peers
from .progress import Progress, no_progress
from .retrieval import kept, model_retrieval, read_pairs


@dataclass
class FrontierPoint:
    """One model on the frontier: its label, what it is ("comera" or "peer"), its bytes, and the share
    of dense recall@1 it keeps per domain with that share's standard error (``retrieval.share_error``)."""

    label: str
    kind: str
    bytes: int
    kept: dict[str, float] = field(default_factory=dict)
    kept_error: dict[str, float] = field(default_factory=dict)

    @classmethod
    def scored(cls, label: str, kind: str, stored: int, scores: dict[str, dict]) -> FrontierPoint:
        """The point of ``scores``: per domain, what ``retrieval.kept`` returns."""
        return cls(label, kind, stored, {name: s["recall_kept"] for name, s in scores.items()},
                   {name: s.get("recall_kept_error", math.nan) for name, s in scores.items()})

    @property
    def mean_kept(self) -> float:
        return sum(self.kept.values()) / len(self.kept)

    @property
    def mean_kept_error(self) -> float:
        """The standard error of ``mean_kept``: each domain's pairs are its own draw, so the domains'
        errors add in quadrature."""
        if not self.kept_error:
            return math.nan
        return math.sqrt(sum(error ** 2 for error in self.kept_error.values())) / len(self.kept_error)

    def to_dict(self) -> dict:
        return {"label": self.label, "kind": self.kind, "bytes": self.bytes, "kept": self.kept,
                "kept_error": self.kept_error, "mean_kept": self.mean_kept,
                "mean_kept_error": self.mean_kept_error}


def size_frontier(models: list[str], pairs=(), texts: int = 200, seq_len: int = 128, peers: bool = True,
                  progress: Progress = no_progress) -> dict:
    """The frontier of ``models`` (compressed checkpoints of one source) and, with ``peers``, of that
    source's peers, on the built-in held-out pairs and the ``pairs`` files (a domain each)."""
    paths = [resolve(name) for name in models]
    configs = [read_config(path) for path in paths]
    sources = {(compression_of(c) or {}).get("source") for c in configs}
    if None in sources or len(sources) != 1:
        raise ConfigError(_one_source_error(models, configs))
    if any(_kind(c) == "clm" for c in configs):
        raise ConfigError("the frontier scores retrieval by sentence embeddings, which causal LMs are not "
                          "evaluated by: compare them with `comera eval` (perplexity per domain)")
    source = sources.pop()
    progress(f"loading {source}")
    reference, _ = load_model(source, task="base")
    reference.eval()
    tokenizer = load_tokenizer(paths[0], "comera frontier")
    domains = {name: domain_pairs(name, texts) for name in DEFAULT_DOMAINS}
    domains.update({Path(file).stem: read_pairs(file, texts) for file in pairs})
    tasks = {}
    for index, (name, found) in enumerate(domains.items()):
        progress(f"dense retrieval on {name}", index, len(domains))
        tasks[name] = Task(found, reference, tokenizer, seq_len, "mean")

    def scored(label: str, kind: str, stored: int, model) -> FrontierPoint:
        progress(f"measuring {label}")
        scores = {name: kept(model_retrieval(model, tokenizer, task.pairs, seq_len), task.dense)
                  for name, task in tasks.items()}
        return FrontierPoint.scored(label, kind, stored, scores)

    points = [scored(name, "comera", weight_bytes(path), from_pretrained(path, task="base").eval())
              for name, path in zip(models, paths)]
    notes = []
    if peers:
        rounded, notes = rounding_peers(reference)
        points += [scored(peer.label, "peer", peer.stored_bytes, peer.model) for peer in rounded]
        points += _static_points(resolve(source), sorted({p.bytes for p in points if p.kind == "comera"}),
                                 configs[0], tasks, notes, progress)
    points.sort(key=lambda point: -point.bytes)
    return {"reference": source, "dense_bytes": float_bytes(reference), "domains": list(tasks),
            "points": [p.to_dict() for p in points], "notes": notes}


def _static_points(source_path, byte_counts: list[int], config: dict, tasks: dict, notes: list[str],
                   progress) -> list[FrontierPoint]:
    """Model2Vec distilled at each of ``byte_counts`` (skipped, with a note, where it is missing), once
    per width (checkpoints of nearly the same bytes get the same one)."""
    points, widths = [], set()
    for stored in byte_counts:
        width = static_dims(stored, config["vocab_size"], config["hidden_size"])
        if width in widths:
            continue
        widths.add(width)
        progress(f"distilling Model2Vec in {stored} bytes")
        static = static_baseline(source_path, stored, config)
        if static is None:
            notes.append(MODEL2VEC_MISSING)
            return points
        points.append(FrontierPoint.scored(static.label, "peer", static.stored_bytes, static.kept(tasks)))
    return points


def _one_source_error(models: list[str], configs: list[dict]) -> str:
    recorded = {name: (compression_of(c) or {}).get("source") for name, c in zip(models, configs)}
    return ("the frontier compares compressed checkpoints of one source model: "
            + ", ".join(f"{name} records {source!r}" for name, source in recorded.items()))


def plot_frontier(frontier: dict, path: Path) -> Path:
    """The mean share kept against the bytes (log scale), each with its standard error as a bar,
    comera's checkpoints and the peers apart."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100)
    axis = fig.subplots()
    for kind, marker, colour in (("comera", "o", "tab:blue"), ("peer", "s", "tab:gray")):
        points = [p for p in frontier["points"] if p["kind"] == kind]
        axis.errorbar([p["bytes"] / 1e6 for p in points], [p["mean_kept"] for p in points],
                      yerr=[p["mean_kept_error"] for p in points], fmt=marker, color=colour, capsize=3,
                      label="comera checkpoints" if kind == "comera" else "peers")
        for p in points:
            axis.annotate(p["label"], (p["bytes"] / 1e6, p["mean_kept"]), fontsize=7, xytext=(3, 3),
                          textcoords="offset points")
    axis.set_xscale("log")
    axis.set_xlabel(f"bytes stored, MB (dense: {frontier['dense_bytes'] / 1e6:.1f} MB)")
    axis.set_ylabel("share of dense recall@1 kept (mean over domains)")
    axis.legend(loc="lower right")
    axis.grid(True, which="both", linewidth=0.3)
    fig.suptitle(f"size frontier of {frontier['reference']}")
    fig.tight_layout()
    return save_figure_atomic(fig, path)
