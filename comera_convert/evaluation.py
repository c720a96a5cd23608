"""How close a compressed model is to its dense source, on held-out text of several domains (`comera eval`).

By default the held-out splits of both built-in corpora are measured (``english``, natural prose of
several genres, and ``python-stdlib``, code), plus any data given; each domain is reported on its
own, and the worst one is named, so that a model fitted to one kind of text shows where it fails.

encoders   mean and minimum cosine of sentence embeddings, and nearest-neighbour agreement (is
           each text's nearest neighbour the same under both models); pooled as the checkpoint's
           sentence-transformers config says (modules.json, its Pooling folder), else by the mean
masked LMs masked-token loss and accuracy of both models (the same deterministic masks)
causal LMs perplexity of both models
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import ConfigError
from .text import CORPORA, documents, is_held_out
from .hf.sentence_config import read_pipeline, sentence_embeddings
from .progress import Progress, no_progress
from .training.objectives import BlockCollator

DEFAULT_DOMAINS = CORPORA  # english and python-stdlib: prose and code


def held_out_texts(source: str, count: int) -> list[str]:
    """Up to ``count`` evaluation texts: a built-in corpus's held-out split (the documents training
    never sees), or any other source's documents as given; a single document is split into paragraphs."""
    if source in CORPORA:
        texts = [t for i, t in enumerate(documents(source)) if is_held_out(i)]
    else:
        texts = list(documents(source))
        if len(texts) == 1:
            texts = [p.strip() for p in texts[0].split("\n\n") if p.strip()]
    return texts[:count]


def _kind(config: dict) -> str:
    from .training.objectives import resolve_objective

    objective = resolve_objective("auto", config)
    architectures = " ".join(config.get("architectures") or [])
    if objective == "clm":
        return "clm"
    return "mlm" if "MaskedLM" in architectures else "encoder"


def _check_match(compressed, reference, reference_name: str) -> None:
    mine, theirs = compressed.config, reference.config
    for field in ("model_type", "hidden_size", "vocab_size"):
        if getattr(mine, field, None) != getattr(theirs, field, None):
            raise ConfigError(f"reference {reference_name} does not match the compressed model: {field} "
                              f"{getattr(theirs, field, None)!r} vs {getattr(mine, field, None)!r}")


def _nearest_neighbours(embeddings: torch.Tensor) -> torch.Tensor:
    normed = F.normalize(embeddings, dim=-1)
    similarity = normed @ normed.T
    similarity.fill_diagonal_(-math.inf)
    return similarity.argmax(dim=-1)


def encoder_metrics(compressed, reference, batch, pooling: str = "mean") -> dict:
    ours, theirs = sentence_embeddings(compressed, batch, pooling), sentence_embeddings(reference, batch, pooling)
    cosine = F.cosine_similarity(ours, theirs, dim=-1)
    agreement = (_nearest_neighbours(ours) == _nearest_neighbours(theirs)).float().mean()
    return {"mean_cosine": float(cosine.mean()), "min_cosine": float(cosine.min()),
            "nn_agreement": float(agreement)}


@torch.no_grad()
def _lm_scores(model, batch, kind: str) -> tuple[float, float]:
    """(mean loss, accuracy over labelled tokens); causal models predict the next token."""
    out = model(**batch)
    labels = batch["labels"]
    logits = out.logits.float()
    if kind == "clm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    mask = labels != -100
    accuracy = (logits.argmax(-1)[mask] == labels[mask]).float().mean()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    return float(loss), float(accuracy)


def domain_batch(tokenizer, source: str, texts: int, seq_len: int) -> dict:
    """One domain's held-out texts, tokenized (padded, truncated to ``seq_len``)."""
    sample = held_out_texts(source, texts)
    if len(sample) < 2:
        raise ConfigError(f"--data {source}: needs at least 2 held-out texts to compare models "
                          f"(found {len(sample)})")
    return tokenizer(sample, padding=True, truncation=True, max_length=seq_len, return_tensors="pt")


def domain_metrics(compressed, reference, tokenizer, kind: str, batch, pooling: str = "mean") -> dict:
    """The comparison on one domain's tokenized texts (see the module docstring for what is measured)."""
    metrics = {"texts": int(batch["input_ids"].shape[0])}
    if kind != "clm":
        metrics.update(encoder_metrics(compressed, reference, batch, pooling))
    if kind in ("mlm", "clm"):
        collate = BlockCollator(kind, tokenizer, 0.15)
        blocks = [{"input_ids": ids[: int(mask.sum())], "index": -1 - i}
                  for i, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"]))]
        length = min(len(b["input_ids"]) for b in blocks)
        lm_batch = collate([{**b, "input_ids": b["input_ids"][:length]} for b in blocks])
        for name, model in (("compressed", compressed), ("reference", reference)):
            loss, accuracy = _lm_scores(model, lm_batch, kind)
            metrics[f"{name}_loss"] = loss
            metrics[f"{name}_accuracy"] = accuracy
            if kind == "clm":
                metrics[f"{name}_perplexity"] = math.exp(min(loss, 50.0))
    return metrics


def worst_domain(domains: dict[str, dict]) -> str:
    """The domain the compressed model is furthest from its reference: the lowest mean cosine for
    encoders, the largest rise of the loss over the reference's for causal LMs."""
    def gap(metrics: dict) -> float:
        if "mean_cosine" in metrics:
            return -metrics["mean_cosine"]
        return metrics["compressed_loss"] - metrics["reference_loss"]

    return max(domains, key=lambda name: gap(domains[name]))


def baseline_models(reference) -> dict:
    """What else makes the dense model smaller, to compare with on the same texts: the whole model
    stored in bfloat16 (2x smaller than float32) and its linear layers dynamically quantized to int8
    (torch.ao, CPU; about 4x smaller linears)."""
    import copy
    import warnings

    from torch import nn

    with warnings.catch_warnings():  # torch deprecates its quantized tensors; still the plain int8 reference
        warnings.simplefilter("ignore")
        int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(reference).float(), {nn.Linear},
                                                      dtype=torch.qint8)
    return {"bfloat16 storage": copy.deepcopy(reference).to(torch.bfloat16), "int8 linears (dynamic)": int8}


def evaluate(compressed_name: str, reference_name: str | None = None, data=None, texts: int = 64,
             seq_len: int = 128, baselines: bool = False, progress: Progress = no_progress) -> dict:
    """Metrics of a compressed checkpoint against its dense reference (the recorded source by
    default), per domain: the built-in corpora's held-out splits and ``data`` (one source or a list).
    ``baselines``: also the same metrics of ``baseline_models`` against the reference."""
    from .hf.config import compression_of
    from .hf.loading import from_pretrained
    from .models import load_model, load_tokenizer, read_config, resolve

    extra = [data] if isinstance(data, str) else list(data or [])
    sources = list(dict.fromkeys([*DEFAULT_DOMAINS, *extra]))
    path = resolve(compressed_name)
    config = read_config(path)
    source = reference_name or (compression_of(config) or {}).get("source")
    if not source:
        raise ConfigError("the checkpoint records no source model: pass --reference DENSE")
    kind = _kind(config)
    task = {"clm": "clm", "mlm": "mlm", "encoder": "base"}[kind]
    progress(f"loading {compressed_name} and {source}")
    compressed = from_pretrained(path, task=task).eval()
    reference, _ = load_model(source, task=task)
    reference.eval()
    _check_match(compressed, reference, source)
    tokenizer = load_tokenizer(path, "comera eval")
    batches = {name: domain_batch(tokenizer, name, texts, seq_len) for name in sources}  # read once
    pipeline = read_pipeline(path)  # a sentence-transformers model pools as its own config says
    pooling = pipeline.pooling if pipeline else "mean"

    def per_domain(model, label="") -> dict:
        measured = {}
        for index, (name, batch) in enumerate(batches.items()):
            progress(f"measuring {label}{name}", index, len(batches))
            measured[name] = domain_metrics(model, reference, tokenizer, kind, batch, pooling)
        return measured

    domains = per_domain(compressed)
    metrics = {"kind": kind, "reference": source, "pooling": pooling, "domains": domains,
               "worst_domain": worst_domain(domains)}
    if baselines:
        metrics["baselines"] = {label: per_domain(model, f"{label}: ")
                                for label, model in baseline_models(reference).items()}
    return metrics


def record_in_report(path: str, metrics: dict) -> None:
    """Add the metrics to the checkpoint's comera_report.json and its model card (atomically)."""
    from .conversion.report import REPORT_FILE, read_report
    from .hf.model_card import source_card, write_model_card
    from .hf.saving import weight_bytes, write_text_atomic

    report = read_report(path)
    if report is None:
        return
    report.extra["eval"] = metrics
    write_text_atomic(Path(path) / REPORT_FILE, report.to_json() + "\n")
    write_model_card(Path(path), report, source_card(path), disk_bytes=weight_bytes(path))
