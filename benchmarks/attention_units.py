"""Which unit of attention to close: whole heads or per-layer ranks, at equal parameters. Writes one record.

    python benchmarks/attention_units.py minilm --name attention-units-minilm --keep 0.75 --keep 0.5 --keep 0.25

Compresses only the attention linears of a dense sentence encoder (everything else stays as it is), each
way to the same share of their parameters, right after calibration and without training, and scores
each on the held-out domains as the share of the dense model's recall@1 kept:

- heads: a head's query, key and value rows and its output columns go as a whole (its context is zero).
  Importance: the increase in the embedding distance to the dense model when that head alone is removed,
  on calibration text the project trains on. Closed globally (least important first) or the same
  number in every layer.
- ranks: each linear becomes a pair of rank r from the activation-whitened SVD (the truncation that
  keeps the most of its output on the calibration text). Closed globally (every layer cut to the same
  share of its output energy lost, a layer kept dense where the pair would not be smaller) or to the
  same rank everywhere.

A head frees 4 x head_dim x hidden parameters from the first one on; a rank pair of a square linear is
smaller only below half its rank. This measures which unit keeps more once the budget needs attention.
"""

from __future__ import annotations

import argparse
import sys
from itertools import islice
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record as records  # noqa: E402
from quality import DOMAIN_HEADERS, _round, held_out_pairs  # noqa: E402

from comera_convert.hf.sentence_config import sentence_embeddings  # noqa: E402
from comera_convert.models import load_model, load_tokenizer, resolve  # noqa: E402
from comera_convert.retrieval import held_out_pairs as builtin_pairs  # noqa: E402
from comera_convert.retrieval import kept, model_retrieval, read_pairs  # noqa: E402
from comera_convert.text import ENGLISH, PYTHON_STDLIB, training_documents  # noqa: E402

CALIBRATION_TEXTS = 128  # english passages the project trains on: never the held-out ones
SEQ_LEN = 128
WHITENING_DAMPING = 1e-4  # of the Gram matrix's mean diagonal, so that its Cholesky factor exists


def attention_blocks(model) -> list:
    return [layer.attention for layer in model.encoder.layer]


def linears(block) -> dict[str, nn.Linear]:
    return {"query": block.self.query, "key": block.self.key, "value": block.self.value, "output": block.output.dense}


# -- calibration ---------------------------------------------------------------------------------------
def calibration_batches(tokenizer) -> list[dict]:
    texts = list(islice(training_documents(ENGLISH), CALIBRATION_TEXTS))
    return [tokenizer(texts[i:i + 16], padding=True, truncation=True, max_length=SEQ_LEN, return_tensors="pt")
            for i in range(0, len(texts), 16)]


@torch.no_grad()
def embeddings(model, batches) -> torch.Tensor:
    return torch.cat([sentence_embeddings(model, batch) for batch in batches])


def distance(model, batches, reference: torch.Tensor) -> float:
    return float((1 - torch.cosine_similarity(embeddings(model, batches), reference)).mean())


@torch.no_grad()
def grams(model, batches) -> dict[tuple[int, str], torch.Tensor]:
    """X^T X of the inputs of each attention linear (query, key and value share theirs), padding left out."""
    found, hooks, mask = {}, [], {}

    def keep(key):
        def hook(_, inputs):
            x = inputs[0][mask["m"]].double()
            found[key] = found.get(key, 0) + x.T @ x
        return hook

    for i, block in enumerate(attention_blocks(model)):
        hooks.append(block.self.query.register_forward_pre_hook(keep((i, "input"))))
        hooks.append(block.output.dense.register_forward_pre_hook(keep((i, "output"))))
    for batch in batches:
        mask["m"] = batch["attention_mask"].bool()
        sentence_embeddings(model, batch)
    for hook in hooks:
        hook.remove()
    return found


# -- heads ---------------------------------------------------------------------------------------------
def head_size(model) -> int:
    return model.config.hidden_size // model.config.num_attention_heads


@torch.no_grad()
def close_head_(block, head: int, size: int) -> None:
    """Remove a head: its output columns to zero (its context no longer reaches the block's output)."""
    block.output.dense.weight[:, head * size:(head + 1) * size] = 0


def head_importance(model, batches, reference) -> dict[tuple[int, int], float]:
    size, found = head_size(model), {}
    for i, block in enumerate(attention_blocks(model)):
        saved = block.output.dense.weight.detach().clone()
        for head in range(model.config.num_attention_heads):
            close_head_(block, head, size)
            found[(i, head)] = distance(model, batches, reference)
            block.output.dense.weight.data.copy_(saved)
    return found


def heads_to_close(importance: dict, heads_per_layer: int, layers: int, close: int, uniform: bool) -> list:
    ranked = sorted(importance, key=importance.get)
    if not uniform:
        return ranked[:close]
    per_layer = close // layers
    return [key for i in range(layers) for key in [k for k in ranked if k[0] == i][:per_layer]]


def head_parameters(model) -> int:
    """Parameters one head holds: its query, key and value rows (with biases) and its output columns."""
    hidden, size = model.config.hidden_size, head_size(model)
    return 3 * size * (hidden + 1) + size * hidden


# -- ranks ---------------------------------------------------------------------------------------------
def whitened_svd(weight: torch.Tensor, gram: torch.Tensor):
    """U, S, Vh of W L (L the Cholesky factor of the Gram matrix) and L^-1: W ~ U_r S_r Vh_r L^-1, and
    S_i^2 is the squared output error on the calibration text of dropping direction i."""
    damping = WHITENING_DAMPING * gram.diagonal().mean()
    factor = torch.linalg.cholesky(gram + damping * torch.eye(len(gram), dtype=gram.dtype))
    u, s, vh = torch.linalg.svd(weight.double() @ factor, full_matrices=False)
    return u, s, vh, torch.linalg.inv(factor)


def pair_parameters(linear: nn.Linear, rank: int) -> int:
    return rank * (linear.in_features + linear.out_features) + (linear.bias is not None) * linear.out_features


def dense_parameters(linear: nn.Linear) -> int:
    return linear.weight.numel() + (0 if linear.bias is None else linear.bias.numel())


@torch.no_grad()
def truncate_(linear: nn.Linear, svd, rank: int) -> int:
    """Replace the weight by its rank-``rank`` whitened truncation when the pair is smaller; returns the
    parameters the layer then holds."""
    if pair_parameters(linear, rank) >= dense_parameters(linear):
        return dense_parameters(linear)
    u, s, vh, inverse = svd
    linear.weight.copy_((u[:, :rank] * s[:rank]) @ vh[:rank] @ inverse)
    return pair_parameters(linear, rank)


def rank_for_loss(svd, share: float) -> int:
    """The smallest rank whose dropped directions lose at most ``share`` of the output energy."""
    energy = svd[1].pow(2)
    tail = energy.flip(0).cumsum(0).flip(0) / energy.sum()  # tail[r]: lost when keeping r
    return int((tail > share).sum())


# -- the variants ----------------------------------------------------------------------------------------
def attention_parameters(model) -> int:
    return sum(dense_parameters(linear) for block in attention_blocks(model) for linear in linears(block).values())


def compress_heads(model, importance, keep: float, uniform: bool) -> int:
    heads = model.config.num_attention_heads
    layers = len(attention_blocks(model))
    close = round((1 - keep) * heads * layers)
    size = head_size(model)
    closed = heads_to_close(importance, heads, layers, close, uniform)
    for i, head in closed:
        close_head_(attention_blocks(model)[i], head, size)
    return attention_parameters(model) - len(closed) * head_parameters(model)


def compress_ranks(model, svds, keep: float, uniform: bool) -> int:
    budget = keep * attention_parameters(model)
    named = [(linear, svds[(i, name)]) for i, block in enumerate(attention_blocks(model))
             for name, linear in linears(block).items()]
    if uniform:
        linear = named[0][0]
        rank = int(budget / len(named) - linear.out_features) // (linear.in_features + linear.out_features)
        return sum(truncate_(linear, svd, rank) for linear, svd in named)
    low, high = 0.0, 1.0
    for _ in range(40):  # the loss share at which every layer's cut meets the budget
        share = (low + high) / 2
        used = sum(min(pair_parameters(linear, rank_for_loss(svd, share)), dense_parameters(linear))
                   for linear, svd in named)
        low, high = (share, high) if used > budget else (low, share)
    return sum(truncate_(linear, svd, rank_for_loss(svd, high)) for linear, svd in named)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--name", required=True)
    parser.add_argument("--keep", type=float, action="append", required=True, help="share of attention parameters")
    parser.add_argument("--texts", type=int, default=400, help="pairs a domain at most")
    parser.add_argument("--heldout", type=Path, default=Path("/tmp/heldout"))
    args = parser.parse_args(argv)
    records.exit_unless_committed()  # the record's commit must reproduce it
    torch.manual_seed(0)
    path = resolve(args.model)
    tokenizer = load_tokenizer(path, "scoring")
    dense = load_model(path)[0].eval()
    pairs = {ENGLISH: builtin_pairs(ENGLISH, args.texts), PYTHON_STDLIB: builtin_pairs(PYTHON_STDLIB, args.texts)}
    pairs.update({file.stem: read_pairs(file, args.texts) for file in held_out_pairs(args.heldout)})
    dense_scores = {domain: model_retrieval(dense, tokenizer, p, SEQ_LEN) for domain, p in pairs.items()}
    batches = calibration_batches(tokenizer)
    reference = embeddings(dense, batches)
    importance = head_importance(dense, batches, reference)
    found = grams(dense, batches)
    svds = {(i, name): whitened_svd(linear.weight, found[(i, "output" if name == "output" else "input")])
            for i, block in enumerate(attention_blocks(dense)) for name, linear in linears(block).items()}
    total = attention_parameters(dense)
    rows = []
    for keep in args.keep:
        for unit, uniform in [("heads", False), ("heads", True), ("ranks", False), ("ranks", True)]:
            model = load_model(path)[0].eval()
            held = (compress_heads(model, importance, keep, uniform) if unit == "heads"
                    else compress_ranks(model, svds, keep, uniform))
            row = {"label": f"{unit}, {'same in every layer' if uniform else 'closed globally'}", "keep": keep,
                   "held": round(held / total, 3), "distance": round(distance(model, batches, reference), 4)}
            shares = []
            for domain, p in pairs.items():
                scores = kept(model_retrieval(model, tokenizer, p, SEQ_LEN), dense_scores[domain])
                row[domain] = records.cell(round(scores["recall_kept"], 4), _round(scores.get("recall_kept_error")))
                shares.append(scores)
            mean = sum(s["recall_kept"] for s in shares) / len(shares)
            error = sum(s.get("recall_kept_error", 0) ** 2 for s in shares) ** 0.5 / len(shares)
            row["mean"] = records.cell(round(mean, 4), _round(error))
            print(row, flush=True)
            rows.append(row)
    columns = [("label", "unit"), ("keep", "attention kept", ".2f"), ("held", "parameters held", ".3f"),
               ("distance", "calibration distance", ".4f"),
               *[(domain, DOMAIN_HEADERS[domain], ".3f") for domain in pairs], ("mean", "mean", ".3f")]
    record = records.new_record(
        args.name, f"{args.model}: closing attention by heads or by per-layer ranks, at equal parameters, "
        "right after calibration", "python benchmarks/attention_units.py " + " ".join(argv or sys.argv[1:]),
        columns, rows,
        notes=[f"only the attention linears are compressed; calibration: {CALIBRATION_TEXTS} english training "
               f"passages at up to {SEQ_LEN} tokens; no training after",
               "calibration distance: mean 1 - cosine to the dense model's embeddings on the calibration text",
               f"{args.texts} pairs a domain at most; shares of dense recall@1 kept ± standard error"])
    print(records.write(record))


if __name__ == "__main__":
    main()
