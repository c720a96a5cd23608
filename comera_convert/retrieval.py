"""Retrieval on query/document pairs: the task a sentence encoder is chosen for, scored for a
compressed model and for its dense source on the same pairs (`comera eval`).

Every query is matched against every document of its domain by the cosine of pooled embeddings;
``recall_at_1`` is the share of queries whose own document comes first, ``mrr`` the mean of
1 / its rank; the share of the dense model's recall@1 a compressed one keeps comes with its
standard error over the queries (``share_error``). Pairs come from held-out text (a passage's
first sentence against the rest of it, among all the domain's passages) or from a JSONL file of
``{"query": ..., "document": ...}`` lines.
"""

from __future__ import annotations

import json
import re
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import ConfigError, expected
from .hf.sentence_config import sentence_embeddings
from .text import held_out_documents

# A first sentence shorter than this (a heading, a shebang, "Hi.") says too little to find its
# passage by; one longer than MAX_QUERY_CHARS is no sentence (a list, a code block).
MIN_QUERY_CHARS = 24
MAX_QUERY_CHARS = 300
MIN_DOCUMENT_CHARS = 80  # the rest must still be a passage, not a closing remark
SENTENCE_END = re.compile(r"[.!?:](?=\s)")
EMBED_BATCH = 64  # texts per forward pass: bounds memory on long domains
PASSAGES_PER_PAIR = 8  # passages read per pair requested (many have no first sentence that splits off)


def split_first_sentence(text: str) -> tuple[str, str] | None:
    """(first sentence, the rest) of a passage, whitespace collapsed; None where either is too short."""
    flat = " ".join(text.split())
    end = SENTENCE_END.search(flat, MIN_QUERY_CHARS)
    if end is None or end.end() > MAX_QUERY_CHARS:
        return None
    query, document = flat[: end.end()], flat[end.end():].strip()
    return (query, document) if len(document) >= MIN_DOCUMENT_CHARS else None


def pairs_from_texts(texts: list[str], count: int) -> list[tuple[str, str]]:
    """Up to ``count`` (first sentence, rest) pairs of distinct passages, in order."""
    pairs, queries = [], set()
    for text in texts:
        pair = split_first_sentence(text)
        if pair is None or pair[0] in queries:
            continue
        queries.add(pair[0])
        pairs.append(pair)
        if len(pairs) == count:
            break
    return pairs


def held_out_pairs(source: str, count: int) -> list[tuple[str, str]]:
    """Up to ``count`` pairs of the held-out documents of a data source (which training never reads)."""
    passages = list(islice(held_out_documents(source), PASSAGES_PER_PAIR * count))
    return pairs_from_texts(passages, count)


def read_pairs(path: str | Path, count: int) -> list[tuple[str, str]]:
    """The first ``count`` pairs of a JSONL file of {"query": ..., "document": ...} lines. Refused in
    one line: a file that is not UTF-8, a line that is not such an object, a query or a document
    given twice (each query has one right document), fewer pairs than ``count``."""
    path = Path(path).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"--pairs {path}: {err.strerror.lower() if err.strerror else err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"--pairs {path}: not UTF-8 text (byte {err.start} is {raw[err.start]:#04x})") from None
    pairs, seen = [], ({}, {})
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        pair = _parse_pair(line, f"--pairs {path} line {number}")
        for field, value, lines in zip(("query", "document"), pair, seen):
            if value in lines:
                raise ConfigError(f"--pairs {path} line {number}: the same {field} as line {lines[value]} "
                                  f"(each query must have exactly one right document)")
            lines[value] = number
        pairs.append(pair)
        if len(pairs) == count:
            return pairs
    raise ConfigError(f"--pairs {path}: {len(pairs)} pairs, fewer than the {count} requested "
                      f"(--texts {count}; pass --texts {len(pairs)} or fewer)")


def _parse_pair(line: str, where: str) -> tuple[str, str]:
    want = 'a JSON object with "query" and "document" strings'
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise ConfigError(f"{where}: {expected(want, line[:60])}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: {expected(want, record)}")
    missing = [f for f in ("query", "document") if not isinstance(record.get(f), str) or not record[f].strip()]
    if missing:
        found = f"no {missing[0]!r} string in an object with keys {sorted(record)}"
        raise ConfigError(f"{where}: {expected(want, found)}")
    return record["query"], record["document"]


@torch.no_grad()
def embed(model, tokenizer, texts: list[str], seq_len: int, pooling: str = "mean") -> torch.Tensor:
    """Pooled embeddings of ``texts`` (truncated to ``seq_len`` tokens), a batch at a time."""
    parts, device = [], next(model.parameters()).device
    for start in range(0, len(texts), EMBED_BATCH):
        batch = tokenizer(texts[start:start + EMBED_BATCH], padding=True, truncation=True, max_length=seq_len,
                          return_tensors="pt").to(device)
        parts.append(sentence_embeddings(model, batch, pooling).cpu())
    return torch.cat(parts)


def retrieval_scores(queries: torch.Tensor, documents: torch.Tensor) -> dict:
    """recall@1 and MRR of query i's own document i among all documents, by cosine; a tie counts
    against the right document."""
    similarity = F.normalize(queries.float(), dim=-1) @ F.normalize(documents.float(), dim=-1).T
    right = similarity.diagonal().unsqueeze(1)
    others = similarity >= right
    others.fill_diagonal_(False)
    rank = others.sum(dim=1)  # 0 where the right document is first
    return {"recall_at_1": float((rank == 0).float().mean()), "mrr": float((1.0 / (rank + 1)).mean()),
            "found": rank == 0}


def model_retrieval(model, tokenizer, pairs: list[tuple[str, str]], seq_len: int, pooling: str = "mean") -> dict:
    """``retrieval_scores`` of one model on ``pairs``."""
    queries, documents = zip(*pairs)
    return retrieval_scores(embed(model, tokenizer, list(queries), seq_len, pooling),
                            embed(model, tokenizer, list(documents), seq_len, pooling))


def kept(scores: dict, dense: dict) -> dict:
    """The scores with the dense model's beside them, the share of its recall@1 kept, and that
    share's standard error where both found-lists are there (``share_error``)."""
    share = scores["recall_at_1"] / dense["recall_at_1"] if dense["recall_at_1"] else float("nan")
    result = {key: value for key, value in scores.items() if key != "found"}
    result.update({"dense_recall_at_1": dense["recall_at_1"], "dense_mrr": dense["mrr"], "recall_kept": share})
    if "found" in scores and "found" in dense and dense["recall_at_1"]:
        result["recall_kept_error"] = share_error(scores["found"], dense["found"])
    return result


def share_error(found: torch.Tensor, dense_found: torch.Tensor) -> float:
    """The standard error of the share of dense recall@1 kept, found.mean() / dense_found.mean(),
    over the same queries (the delta method for a ratio of paired means): what the queries on which
    the two models disagree leave uncertain; 0 where they agree on every query. On 400 english pairs
    right after conversion about 0.03 (docs/findings.md)."""
    found, dense_found = found.double(), dense_found.double()
    if found.numel() < 2:
        return float("nan")
    share = found.mean() / dense_found.mean()
    return float((found - share * dense_found).std() / dense_found.mean() / found.numel() ** 0.5)
