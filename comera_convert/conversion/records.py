"""Module records: what a compressed checkpoint stores about each converted module, and the
functions that build TT modules from records (when loading) or records from modules (when saving).

A record is a JSON-able dict:
    {"kind": "linear", "spec": {...TTSpec...}, "bias": true, "gates": true}
    {"kind": "embedding", "spec": {...}, "padding_idx": 0, "gates": true, "reordered": false}
    {"kind": "codebook_embedding", "spec": {...CodebookSpec...}, "padding_idx": 0}
    {"kind": "tied_head", "embedding": "bert.embeddings.word_embeddings", "bias": true}
    {"kind": "pruned_linear", "in_features": 768, "out_features": 1920, "pruned": "out",
     "dense_features": 3072, "bias": true}
"""

from __future__ import annotations

import torch
from torch import nn

from ..codebook import CodebookSpec
from ..errors import ModelLoadError, expected
from ..layers import CodebookEmbedding, PrunedLinear, TiedTTHead, TTEmbedding, TTLinear, TTModule
from ..layers.swap import set_submodule
from ..layers.tied_head import TIEABLE
from ..tt.spec import TTSpec

KINDS = ("linear", "embedding", "codebook_embedding", "tied_head", "pruned_linear")
COMPRESSED = (TTModule, CodebookEmbedding, TiedTTHead, PrunedLinear)  # the modules a checkpoint records


def record_of(module: nn.Module, model: nn.Module | None = None) -> dict:
    """The record of a live converted module (its current ranks, after any pruning)."""
    if isinstance(module, TTLinear):
        return {"kind": "linear", "spec": module.spec.to_dict(), "bias": module.bias is not None,
                "gates": module.gated, "dense_class": module.dense_class}
    if isinstance(module, TTEmbedding):
        return {"kind": "embedding", "spec": module.spec.to_dict(), "padding_idx": module.padding_idx,
                "gates": module.gated, "reordered": module.row_of_token is not None}
    if isinstance(module, CodebookEmbedding):
        return {"kind": "codebook_embedding", "spec": module.spec.to_dict(), "padding_idx": module.padding_idx}
    if isinstance(module, TiedTTHead):
        names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        return {"kind": "tied_head", "embedding": names.get(id(module.embedding)),
                "bias": module.bias is not None}
    if isinstance(module, PrunedLinear):
        return {"kind": "pruned_linear", "in_features": module.in_features, "out_features": module.out_features,
                "pruned": module.pruned, "dense_features": module.dense_features, "bias": module.bias is not None}
    raise TypeError(expected("a TTLinear, TTEmbedding, CodebookEmbedding, TiedTTHead or PrunedLinear",
                             type(module).__name__))


def records_of(model: nn.Module) -> dict[str, dict]:
    """Records of every converted module of a model, by module name."""
    return {name: record_of(module, model) for name, module in model.named_modules()
            if isinstance(module, COMPRESSED)}


def _check(record: dict, name: str) -> None:
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        raise ModelLoadError(f"the compression record of {name!r} is not valid: "
                             + expected(f"a dict with kind in {KINDS}", record))


def module_from_record(record: dict, name: str, dtype=None, device=None) -> nn.Module:
    """An (uninitialized) TT module of the record's shape, ready to receive the saved tensors."""
    _check(record, name)
    if record["kind"] == "tied_head":
        raise ValueError("tied heads are built by tie_heads, after their embedding")
    if record["kind"] == "pruned_linear":
        try:
            return PrunedLinear(record["in_features"], record["out_features"], bias=record.get("bias", True),
                                pruned=record["pruned"], dense_features=record["dense_features"],
                                device=device, dtype=dtype)
        except (KeyError, TypeError, ValueError) as err:
            raise ModelLoadError(f"the compression record of {name!r} is not a valid pruned linear: {err}") from None
    if record["kind"] == "codebook_embedding":
        spec = CodebookSpec.from_dict(record["spec"])
        return CodebookEmbedding(spec.rows, spec.cols, record.get("padding_idx"), subspaces=spec.subspaces,
                                 codewords=spec.codewords, device=device, dtype=dtype)
    spec = TTSpec.from_dict(record["spec"])
    common = dict(rank=spec.ranks, layout=spec.layout, d=len(spec.row_modes), gates=record.get("gates", True),
                  device=device, dtype=dtype)
    if record["kind"] == "linear":
        layer = TTLinear(spec.rows, spec.cols, bias=record.get("bias", True), in_modes=spec.row_modes,
                         out_modes=spec.col_modes, **common)
        layer.dense_class = record.get("dense_class", "Linear")
    else:
        layer = TTEmbedding(spec.rows, spec.cols, record.get("padding_idx"), row_modes=spec.row_modes,
                            col_modes=spec.col_modes, reordered=record.get("reordered", False), **common)
    if layer.spec != spec:  # a pruned bond larger than a planned (clipped) one would be: its saved size
        layer.resize_bonds_(spec.ranks)
    return layer


def format_version(records: dict[str, dict]) -> int:
    """The oldest checkpoint format that can hold these records: 5 once a feed-forward pair is pruned,
    3 once an embedding is a codebook table, 2 once one is reordered (a reader of version 1 would
    ignore the order and look up the wrong rows), 1 otherwise."""
    if any(r.get("kind") == "pruned_linear" for r in records.values()):
        return 5
    if any(r.get("kind") == "codebook_embedding" for r in records.values()):
        return 3
    return 2 if any(r.get("reordered") for r in records.values()) else 1


def tie_head(model: nn.Module, name: str, record: dict) -> TiedTTHead:
    """Replace the head ``name`` by a TiedTTHead over the (already converted) embedding."""
    embedding = model.get_submodule(record["embedding"])
    if not isinstance(embedding, TIEABLE):
        raise ModelLoadError(f"{name!r} is recorded as tied to {record['embedding']!r}, "
                             + expected("a TTEmbedding or CodebookEmbedding there", type(embedding).__name__))
    old = model.get_submodule(name)
    bias = getattr(old, "bias", None) if record.get("bias") else None
    head = TiedTTHead(embedding, bias=bias)
    set_submodule(model, name, head)
    return head


def resolve_name(model: nn.Module, name: str) -> str | None:
    """The name of a recorded module in this model: as recorded, or across the base-model prefix
    (a checkpoint of BertModel loaded as BertForMaskedLM names ``encoder.*`` for ``bert.encoder.*``).

    None for a head that a base model loaded from a checkpoint with a head does not have, and for a
    part of a base model that a model with a head leaves out.
    """
    prefix = getattr(model, "base_model_prefix", "")
    for candidate in (name, f"{prefix}.{name}", name.removeprefix(prefix + ".")):
        try:
            model.get_submodule(candidate)
            return candidate
        except AttributeError:
            continue
    if prefix and not name.startswith(prefix + "."):
        # A head the base model does not have, or a part of a base model's checkpoint that the model
        # with a head on top leaves out (BertForMaskedLM has no pooler): unused, as transformers
        # leaves a checkpoint's unexpected weights.
        return None
    raise ModelLoadError(f"the checkpoint records a compressed module {name!r} that the model "
                         f"{type(model).__name__} does not have")


def build_from_records(model: nn.Module, records: dict[str, dict], dtype=None, device=None) -> None:
    """Swap the model's modules for TT modules of the recorded shapes (weights are loaded later).

    Records of modules the model does not have are an error, except heads: a base model loaded
    from a checkpoint of a model with a head simply has no head.
    """
    for name, record in records.items():
        _check(record, name)
        target = resolve_name(model, name)
        if record["kind"] != "tied_head" and target is not None:
            set_submodule(model, target, module_from_record(record, name, dtype=dtype, device=device))
    for name, record in records.items():
        target = resolve_name(model, name)
        if record["kind"] == "tied_head" and target is not None:
            tie_head(model, target, dict(record, embedding=resolve_name(model, record["embedding"])))


def tie_heads_to_converted_embeddings(model: nn.Module) -> None:
    """Heads that a checkpoint does not record (a base model loaded with an LM head on top) but that
    transformers ties to the input embedding become TiedTTHeads when that embedding is compressed:
    the new head starts from the embedding, as it would on a dense model."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "tie_word_embeddings", False):
        return
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return
    embedding, head = get_in(), get_out()
    if isinstance(embedding, TIEABLE) and isinstance(head, nn.Linear):
        name = next(n for n, m in model.named_modules() if m is head)
        set_submodule(model, name, TiedTTHead(embedding, bias=head.bias))


def tensor_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Shapes of every tensor in the model's state dict (what its checkpoint must hold)."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
