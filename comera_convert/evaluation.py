"""How close a compressed model is to its dense source, on held-out text of several domains (`comera eval`).

By default the held-out splits of both built-in corpora are measured (``english``, natural prose of
several genres, and ``python-stdlib``, code), plus any data given; each domain is reported on its
own, and the worst one is named, so that a model fitted to one kind of text shows where it fails.

encoders   mean and minimum cosine of sentence embeddings, and nearest-neighbour agreement (is
           each text's nearest neighbour the same under both models); pooled as the checkpoint's
           sentence-transformers config says (modules.json, its Pooling folder), else by the mean;
           and the task: retrieval (recall@1, MRR; ``retrieval.py``) of each passage's rest by its
           first sentence among all the domain's passages, or of the documents of a JSONL file of
           query/document pairs, with the share of the dense model's recall@1 kept
masked LMs masked-token loss and accuracy of both models (the same deterministic masks)
causal LMs perplexity of both models

``dense``: module-name patterns whose compressed modules are put back dense (the reference's) before
scoring, to find which layers carry the loss (the word table alone, the linears alone, a block).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .conversion import count_params
from .conversion.pruning import pruned_partner
from .conversion.report import REPORT_FILE, read_report
from .conversion.targets import matches
from .errors import ConfigError, expected
from .hf.config import compression_of
from .hf.files import write_text_atomic
from .hf.loading import from_pretrained
from .hf.model_card import source_card, write_model_card
from .hf.saving import weight_bytes
from .hf.sentence_config import read_pipeline, sentence_embeddings
from .layers.swap import set_submodule
from .models import load_model, load_tokenizer, read_config, resolve
from .peers import float_bytes, rounding_peers
from .progress import Progress, no_progress
from .retrieval import PASSAGES_PER_PAIR, kept, model_retrieval, pairs_from_texts, read_pairs, retrieval_scores
from .text import BUILTIN_SOURCES, CORPORA, documents, held_out_documents
from .training.objectives import BlockCollator, resolve_objective

DEFAULT_DOMAINS = CORPORA  # english and python-stdlib: prose and code


def held_out_texts(source: str, count: int) -> list[str]:
    """Up to ``count`` evaluation texts: a built-in corpus's held-out split (the documents training
    never sees), or any other source's documents as given; a single document is split into paragraphs."""
    if source in BUILTIN_SOURCES:
        texts = list(held_out_documents(source))
    else:
        texts = list(documents(source))
        if len(texts) == 1:
            texts = [p.strip() for p in texts[0].split("\n\n") if p.strip()]
    return texts[:count]


def _kind(config: dict) -> str:
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


def domain_batch(tokenizer, source: str, sample: list[str], seq_len: int) -> dict:
    """One domain's held-out texts, tokenized (padded, truncated to ``seq_len``)."""
    if len(sample) < 2:
        raise ConfigError(f"--data {source}: needs at least 2 held-out texts to compare models "
                          f"(found {len(sample)})")
    return tokenizer(sample, padding=True, truncation=True, max_length=seq_len, return_tensors="pt")


def domain_pairs(source: str, count: int) -> list[tuple[str, str]]:
    """Up to ``count`` query/document pairs of a domain's held-out passages (``pairs_from_texts``)."""
    return pairs_from_texts(held_out_texts(source, PASSAGES_PER_PAIR * count), count)


def domain_metrics(compressed, reference, tokenizer, kind: str, batch, pooling: str = "mean",
                   task: "Task | None" = None) -> dict:
    """The comparison on one domain's tokenized texts (see the module docstring for what is
    measured); ``task``: the domain's pairs and the dense model's scores on them."""
    metrics = {"texts": int(batch["input_ids"].shape[0])}
    if kind != "clm":
        metrics.update(encoder_metrics(compressed, reference, batch, pooling))
    if task is not None:
        metrics["pairs"] = len(task.pairs)
        metrics.update(kept(model_retrieval(compressed, tokenizer, task.pairs, task.seq_len, pooling), task.dense))
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


class Task:
    """One domain's retrieval pairs and the dense model's scores on them (computed once, shared by
    the compressed model and every baseline)."""

    def __init__(self, pairs: list[tuple[str, str]], reference, tokenizer, seq_len: int, pooling: str):
        self.pairs, self.seq_len = pairs, seq_len
        self.dense = model_retrieval(reference, tokenizer, pairs, seq_len, pooling)


def worst_domain(domains: dict[str, dict]) -> str:
    """The domain the compressed model is furthest from its reference: the lowest mean cosine for
    encoders, the largest rise of the loss over the reference's for causal LMs."""

    def gap(metrics: dict) -> float:
        if "mean_cosine" in metrics:
            return -metrics["mean_cosine"]
        return metrics["compressed_loss"] - metrics["reference_loss"]

    return max(domains, key=lambda name: gap(domains[name]))


# model2vec's `distill` extra pins transformers below 5.4; its distillation itself needs only
# skeletoken besides, and runs on transformers 5.24 (the `peers` extra installs the two).
MODEL2VEC_MISSING = ("Model2Vec baseline skipped: it needs model2vec's distillation: "
                     "pip install 'comera-convert[peers]' (model2vec and skeletoken)")


def static_dims(stored_bytes: int, vocab_size: int, width: int) -> int:
    """Model2Vec's width in ``stored_bytes``: one int8 per vocabulary entry and dimension, at most the
    model's width."""
    return max(1, min(width, round(stored_bytes / vocab_size)))


class StaticBaseline:
    """Model2Vec's static embeddings distilled from the dense source (each token's output embedding,
    reduced by PCA, weighted by token frequency): no transformer at all, in as many bytes as the
    compressed model's weights, stored as Model2Vec's own int8 table (the PCA width is bytes /
    vocabulary, at most the model's width)."""

    def __init__(self, source_path, stored_bytes: int, vocab_size: int, width: int):
        from model2vec.distill import distill

        self.dims = static_dims(stored_bytes, vocab_size, width)
        self.model = distill(model_name=str(source_path), pca_dims=self.dims, device="cpu", quantize_to="int8")
        self.label = f"Model2Vec int8, {self.dims} dims"
        self.stored_bytes = vocab_size * self.dims

    def scores(self, pairs: list[tuple[str, str]]) -> dict:
        queries, documents = zip(*pairs)
        return retrieval_scores(*(torch.from_numpy(self.model.encode(list(texts))) for texts in (queries, documents)))

    def kept(self, tasks: dict) -> dict:
        """Per domain: its retrieval scores beside the dense model's (``retrieval.kept``)."""
        return {name: kept(self.scores(task.pairs), task.dense) for name, task in tasks.items()}


def static_baseline(source_path, stored_bytes: int, config) -> StaticBaseline | None:
    """The Model2Vec peer at ``stored_bytes``, or None where model2vec's distillation is not installed."""
    try:
        import model2vec.distill  # noqa: F401
    except ImportError:
        return None
    return StaticBaseline(source_path, stored_bytes, config["vocab_size"], config["hidden_size"])


@dataclass
class Compared:
    """A compressed checkpoint loaded beside its dense reference, with what both are measured by."""

    compressed: torch.nn.Module
    reference: torch.nn.Module
    tokenizer: object
    kind: str  # "encoder", "mlm" or "clm"
    pooling: str  # how sentence embeddings are pooled (the checkpoint's sentence-transformers config)
    path: Path
    config: dict
    source: str  # the reference's name


def load_compared(compressed_name: str, reference_name: str | None = None, command: str = "comera eval",
                  progress: Progress = no_progress) -> Compared:
    """The compressed checkpoint and its dense reference (the recorded source unless named), in eval mode."""
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
    pipeline = read_pipeline(path)  # a sentence-transformers model pools as its own config says
    return Compared(compressed, reference, load_tokenizer(path, command), kind,
                    pipeline.pooling if pipeline else "mean", path, config, source)


def restore_dense(compressed: torch.nn.Module, reference: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Put the reference's dense module back in place of each compressed one whose name matches a
    pattern (a glob or a dot-separated part, as `comera convert --exclude` takes them), and the other
    side of each pruned feed-forward pair so chosen; returns the names put back. Raises ConfigError
    for a pattern that matches no compressed module."""
    compressed_modules = dict(compressed.named_modules())
    replaced = [name for name, module in reference.named_modules()
                if name in compressed_modules and not list(module.children())
                and type(compressed_modules[name]) is not type(module)]
    for pattern in patterns:
        if not any(matches(name, pattern) for name in replaced):
            raise ConfigError(expected(f"--dense patterns matching compressed modules (such as "
                                       f"{', '.join(replaced[:3])})", pattern))
    chosen = [name for name in replaced if any(matches(name, pattern) for pattern in patterns)]
    partners = [pruned_partner(name, compressed_modules) for name in chosen]  # a pruned pair goes back whole
    chosen += [name for name in dict.fromkeys(partners) if name is not None and name not in chosen]
    for name in chosen:
        set_submodule(compressed, name, copy.deepcopy(reference.get_submodule(name)))
    return chosen


def evaluate(compressed_name: str, reference_name: str | None = None, data=None, texts: int = 64,
             seq_len: int = 128, baselines: bool = False, progress: Progress = no_progress,
             pairs=None, dense=None) -> dict:
    """Metrics of a compressed checkpoint against its dense reference (the recorded source by
    default), per domain: the built-in corpora's held-out splits, ``data`` (one source or a list)
    and ``pairs`` (JSONL files of query/document pairs, a domain each, named by the file).
    ``baselines``: also the same metrics of the peers (``peers.py``, and Model2Vec at equal bytes), and
    every model's size in bytes (``sizes``)."""
    extra = [data] if isinstance(data, str) else list(data or [])
    sources = list(dict.fromkeys([*DEFAULT_DOMAINS, *extra]))
    if dense and baselines:
        raise ConfigError("--dense with --baselines: the peers are compared at the checkpoint's bytes, which a "
                          "model with modules put back dense no longer has (drop one of the two)")
    compared = load_compared(compressed_name, reference_name, "comera eval", progress)
    compressed, reference, tokenizer = compared.compressed, compared.reference, compared.tokenizer
    restored = restore_dense(compressed, reference, dense) if dense else []
    kind, path, config, source = compared.kind, compared.path, compared.config, compared.source
    pair_files = [pairs] if isinstance(pairs, (str, Path)) else list(pairs or [])
    if pair_files and kind == "clm":
        raise ConfigError("--pairs scores retrieval by sentence embeddings, which causal LMs are not "
                          "evaluated by: their domains report perplexity")
    batches, tasks = _domains(sources, pair_files, compared, texts, seq_len, progress)
    pooling = compared.pooling

    def per_domain(model, label="") -> dict:
        measured = {}
        for index, (name, batch) in enumerate(batches.items()):
            progress(f"measuring {label}{name}", index, len(batches))
            measured[name] = domain_metrics(model, reference, tokenizer, kind, batch, pooling, tasks.get(name))
        return measured

    domains = per_domain(compressed)
    metrics = {"kind": kind, "reference": source, "pooling": pooling, "domains": domains,
               "worst_domain": worst_domain(domains)}
    if restored:
        metrics["restored_dense"] = restored
    if baselines:
        metrics.update(_peers(compressed, reference, path, source, config, tasks, per_domain, progress))
    return metrics


def _domains(sources, pair_files, compared, texts: int, seq_len: int, progress) -> tuple[dict, dict]:
    """(each domain's batch of texts, each encoder domain's retrieval task). Each domain's held-out passages
    are read once: the first ``texts`` are compared as they are, and (encoders) all of them are split into
    retrieval pairs; ``pair_files`` add domains of their own pairs."""
    kind, tokenizer = compared.kind, compared.tokenizer
    reach = texts * (PASSAGES_PER_PAIR if kind != "clm" else 1)
    passages = {name: held_out_texts(name, reach) for name in sources}
    batches = {name: domain_batch(tokenizer, name, passages[name][:texts], seq_len) for name in sources}
    tasks = {}
    if kind == "clm":
        return batches, tasks
    found = {name: pairs_from_texts(passages[name], texts) for name in sources}
    for file in pair_files:
        name = pair_domain_name(file, found)
        found[name] = read_pairs(file, texts)
        batches[name] = domain_batch(tokenizer, name, [document for _, document in found[name]], seq_len)
    for index, (name, domain) in enumerate(found.items()):
        progress(f"dense retrieval on {name}", index, len(found))
        if len(domain) >= 2:  # one pair is no ranking: such a domain reports cosines alone
            tasks[name] = Task(domain, compared.reference, tokenizer, seq_len, compared.pooling)
    return batches, tasks


def _peers(compressed, reference, path, source, config, tasks, per_domain, progress) -> dict:
    """The peers' metrics on the same domains, every model's bytes (``sizes``) and notes on the peers
    that could not run."""
    own_bytes, dense_params = weight_bytes(path), count_params(reference)
    sizes = {"dense": {"parameters": dense_params, "bytes": float_bytes(reference)},
             "compressed": {"parameters": count_params(compressed), "bytes": own_bytes}}
    peers, notes = rounding_peers(reference)
    results = {}
    for peer in peers:
        results[peer.label] = per_domain(peer.model, f"{peer.label}: ")
        sizes[peer.label] = {"parameters": dense_params, "bytes": peer.stored_bytes}
    if tasks:
        progress("distilling the Model2Vec baseline")
        static = static_baseline(resolve(source), own_bytes, config)
        if static is None:
            notes.append(MODEL2VEC_MISSING)
        else:
            results[static.label] = {name: {"texts": len(tasks[name].pairs), "pairs": len(tasks[name].pairs), **scores}
                                     for name, scores in static.kept(tasks).items()}
            sizes[static.label] = {"parameters": static.stored_bytes, "bytes": static.stored_bytes}
    return {"baselines": results, "sizes": sizes, **({"notes": notes} if notes else {})}


def pair_domain_name(file, taken) -> str:
    """A pair file's domain name: its stem, or its whole path where ``taken`` already holds the stem."""
    name = Path(file).stem
    return name if name not in taken else str(file)


def record_in_report(path: str, metrics: dict) -> None:
    """Add the metrics to the checkpoint's comera_report.json and its model card (atomically)."""
    report = read_report(path)
    if report is None:
        return
    report.extra["eval"] = metrics
    write_text_atomic(Path(path) / REPORT_FILE, report.to_json() + "\n")
    write_model_card(Path(path), report, source_card(path), disk_bytes=weight_bytes(path))
