"""Embedding throughput of a real checkpoint on a CPU, beside its dense source and the peers a deployer
tries first, with the quality each keeps (`comera bench inference --checkpoint PATH`).

Methods: the dense model; the dense model with its linears in int8 (torch's dynamic quantization,
``quantize_dynamic``); the compressed model in float32; the compressed model with int8 compute
(``layers.use_int8_compute``); with ``compile_models``, each of the four under ``torch.compile`` as
well (inductor fuses the elementwise work between the GEMMs and takes away Python's per-layer
overhead; the int8 GEMMs stay torch's quantized kernels; compiling happens in the untimed
warm-up). Texts are embedded as sentence-transformers' ``encode`` does: sorted by length, in
batches of ``BATCH``. Each timed round runs every method once, in turn, and each method reports its
median round (rounds side by side: the machine's drift meets every method alike); several checkpoints are
timed one at a time, each in rounds of its own beside dense and the routes with no comera.
Quality: each method's retrieval recall@1 on query/document pairs as a share of the dense model's (a
compiled method is scored as its eager source).
"""

from __future__ import annotations

import copy
import gc
import os
import shutil
import statistics
import time
import warnings
from itertools import zip_longest
from pathlib import Path

import torch

from ..errors import ConfigError
from ..evaluation import load_compared, pair_domain_name
from ..hf.openvino_export import openvino_installed
from ..layers import use_int8_compute
from ..retrieval import held_out_pairs, kept, model_retrieval, read_pairs
from .onnx_serving import (DENSE_ONNX, DENSE_ONNX_INT8, OURS_ONNX, OURS_ONNX_INT8, PEER, graph_megabytes, onnx_methods,
                           peer_methods)
from .openvino_serving import (DENSE_OPENVINO, DENSE_OPENVINO_INT8, OURS_OPENVINO, OURS_OPENVINO_INT8,
                               openvino_methods)

BATCH = 32  # sentence-transformers' default encode batch
SEQ_LEN = 256  # tokens a text is cut to (the longest MiniLM and MPNet sentence models embed)
DENSE, DENSE_INT8, OURS, OURS_INT8 = ("dense", "dense, int8 dynamic (torch)", "comera float32", "comera int8 compute")
COMPILED = ", torch.compile"  # the suffix of a compiled method's name
# The dense graphs a user gets from sentence-transformers' backends with no comera at all (its OpenVINO backend
# in the runtime's default precision, its int8 exports as they quantize), beside the exports given as --peer.
ZERO_EFFORT = (DENSE_OPENVINO, DENSE_OPENVINO_INT8, DENSE_ONNX_INT8)
# The methods that measure the compressed checkpoint (a label follows each where several are measured).
COMPRESSED_METHODS = (OURS, OURS_INT8, OURS_ONNX, OURS_ONNX_INT8, OURS_OPENVINO, OURS_OPENVINO_INT8)


def quantized_dense(reference: torch.nn.Module) -> torch.nn.Module:
    """The dense model with every nn.Linear in int8 by torch's dynamic quantization (a copy)."""
    with warnings.catch_warnings():  # torch announces the eager quantization API's move to torchao
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(reference), {torch.nn.Linear}, dtype=torch.qint8)


def int8_compute_copy(compressed: torch.nn.Module) -> torch.nn.Module:
    """The compressed model with int8 GEMMs (a copy)."""
    model = copy.deepcopy(compressed)
    use_int8_compute(model)
    return model


def require_cpp_compiler() -> None:
    """Refuse in one line where torch.compile's CPU backend (inductor) would find no C++ compiler: it
    builds its kernels with ``$CXX`` (g++ unless set)."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise ConfigError(f"--compile: torch.compile builds CPU kernels with a C++ compiler, and {compiler!r} "
                          "is not on PATH (install g++, or set CXX to one)")


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` under ``torch.compile`` with dynamic shapes: the length-sorted batches differ in
    length, and one graph serves them all instead of one compilation per length.

    torch's quantized int8 kernels break the graph at every call, and a broken graph's inner
    forwards (each block's attention, its feed-forward) are compiled again per module instance,
    guarded on that instance's ranks: past dynamo's recompile limit (8 a function) the later blocks
    would run eagerly, so the limit is raised to the model's module count."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    setattr(config, limit, max(getattr(config, limit), len(list(model.modules()))))
    return torch.compile(model, dynamic=True)


def eager_name(name: str) -> str:
    """The method a compiled one compiles: a compiled copy computes the same function with the same
    weights, so it is scored as its eager source is (scoring it again would double the retrieval's
    time, the larger part of a 768-wide run)."""
    return name.removesuffix(COMPILED)


def length_sorted_batches(tokenizer, texts: list[str], batch: int = BATCH) -> list[dict]:
    """The texts tokenized in batches of ``batch``, shortest first (as ``encode`` batches them)."""
    ordered = sorted(texts, key=lambda text: len(tokenizer.tokenize(text)))
    return [tokenizer(ordered[start:start + batch], padding=True, truncation=True, max_length=SEQ_LEN,
                      return_tensors="pt") for start in range(0, len(ordered), batch)]


@torch.inference_mode()
def _embed_all(model, batches) -> None:
    for batch in batches:
        model(**batch)


def timed_rounds(models: dict, batches: list[dict], repeats: int) -> dict[str, list[float]]:
    """Seconds of one pass over ``batches`` per model and round, the models taking turns each round."""
    for model in models.values():  # warm-up: first-call allocations and packing
        _embed_all(model, batches[:2])
    rounds = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            _embed_all(model, batches)
            rounds[name].append(time.perf_counter() - start)
    return rounds


def round_ratios(rounds: dict[str, list[float]], against: str) -> dict[str, tuple[float, float]]:
    """Each model's speed against ``against``'s as (median, standard error) over the rounds, each round's
    ratio taken within the round (the machine's drift meets both alike)."""
    ratios = {}
    for name, seconds in rounds.items():
        per_round = [base / mine for base, mine in zip(rounds[against], seconds)]
        error = statistics.stdev(per_round) / len(per_round) ** 0.5 if len(per_round) > 1 else float("nan")
        ratios[name] = (statistics.median(per_round), error)
    return ratios


def zero_effort(names) -> list[str]:
    """The methods a user gets from the dense model with no comera at all: sentence-transformers' own exports
    (``--peer``), and the dense graphs as sentence-transformers' backends make them (OpenVINO in its default
    precision, int8 as its exports quantize)."""
    return [name for name in names if name in ZERO_EFFORT or name.startswith(PEER)]


def serving_case(checkpoint, reference_name: str | None, pair_files, texts: int, repeats: int,
                 progress=None, compile_models: bool = False, onnx: bool = False, peers=(),
                 batch: int = BATCH, forms: str = "auto") -> list[dict]:
    """One row per method: sentences a second, speed against dense and against the fastest route that costs
    no effort (``zero_effort``; each a median over the rounds with its standard error), and recall@1 kept per
    pair domain (each of ``pair_files``, else the built-in english corpus's held-out pairs) with its standard
    error, and the worst domain's. ``checkpoint``: one compressed checkpoint or several of one source, their
    methods side by side (each named after its folder where there are several); ``compile_models`` adds each
    method under ``torch.compile``, ``onnx`` the dense and the compressed models in ONNX Runtime and, where it
    is installed, OpenVINO, float and int8, and each graph of ``peers`` (``onnx_serving.py``,
    ``openvino_serving.py``); texts are embedded ``batch`` at a time (1: one request at a time, as an online
    service embeds); ``forms``: the compressed graphs' serving forms (``form_timing.plan_forms``)."""
    progress = progress or (lambda message: None)
    if compile_models:
        require_cpp_compiler()
    checkpoints = [checkpoint] if isinstance(checkpoint, (str, Path)) else list(checkpoint)
    compared = [load_compared(str(path), reference_name, "comera bench", progress) for path in checkpoints]
    _check_one_source(checkpoints, compared)
    first = compared[0]
    labels = {Path(c.path).name if len(compared) > 1 else "": c for c in compared}
    progress("int8 copy of the dense model")
    dense = _with_compiled({DENSE: first.reference, DENSE_INT8: quantized_dense(first.reference)}, compile_models)
    if onnx:
        dense.update(dense_runtime_methods(first, progress, peers))
    domains = _pair_domains(pair_files, texts)
    documents = interleaved([[document for _, document in pairs] for pairs in domains.values()])[:texts]
    batches = length_sorted_batches(first.tokenizer, documents, batch)
    scores = _scores(dense, domains, first, progress)
    groups, made = [], {name: _graph_facts(model) for name, model in dense.items()}
    for index, (label, each) in enumerate(labels.items()):
        group = checkpoint_methods(each, label, first.tokenizer, progress, compile_models, onnx, forms)
        timed = (dense if index == 0 else _anchors(dense)) | group
        progress(f"timing {len(documents)} texts, {repeats} rounds of {len(timed)} models"
                 + (f" (checkpoint {index + 1}/{len(labels)})" if label else "")
                 + (" (compiling first)" if compile_models else ""))
        groups.append(timed_rounds(timed, batches, repeats))
        for domain, by_name in _scores(group, domains, first, progress).items():
            scores[domain] |= by_name
        made |= {name: _graph_facts(model) for name, model in group.items()}
        del group, timed  # one checkpoint's sessions at a time: each runtime's caches grow with the shapes it sees
        gc.collect()
    quality = {domain: {name: kept(by_name[eager_name(name)], by_name[DENSE]) for name in made}
               for domain, by_name in scores.items()}
    tokens = sum(int(encoded["attention_mask"].sum()) for encoded in batches)
    shape = f"{first.source}, {len(documents)} texts ({tokens / len(documents):.0f} tokens avg), batch {batch}"
    rounds = {name: _rounds_of(name, groups) for name in made}
    speeds = {name: len(documents) / statistics.median(seconds[name]) for name, seconds in rounds.items()}
    routes = zero_effort(made)
    peer = max(routes, key=speeds.get) if routes else None
    against = {"dense": {name: round_ratios(seconds, DENSE)[name] for name, seconds in rounds.items()},
               "peer": {name: round_ratios(seconds, peer)[name] for name, seconds in rounds.items()} if peer else {}}
    case = "serving" if onnx else "inference"
    return [_row(name, made[name], case, shape, speeds[name], against, quality, peer, _label_of(name, labels))
            for name in made]


def _with_compiled(models: dict, compile_models: bool) -> dict:
    """``models``, and each under ``torch.compile`` as well where ``compile_models``."""
    return models | ({name + COMPILED: compiled(model) for name, model in models.items()} if compile_models else {})


def checkpoint_methods(each, label: str, tokenizer, progress, compile_models: bool, onnx: bool,
                       forms: str) -> dict:
    """One compressed checkpoint's methods (named after ``label`` where several are measured): PyTorch float
    and int8 compute (each under torch.compile too with ``compile_models``), and with ``onnx`` its ONNX Runtime
    and OpenVINO graphs."""
    progress("int8 copy of the compressed model" + (f" {label}" if label else ""))
    methods = _with_compiled({_labelled(OURS, label): each.compressed,
                              _labelled(OURS_INT8, label): int8_compute_copy(each.compressed)}, compile_models)
    if onnx:
        for make, names in _runtimes(lambda message: None):  # the dense methods said which are missing
            methods.update(make(each.compressed, tuple(_labelled(n, label) for n in names[1]), tokenizer,
                                progress, forms))
    return methods


def _anchors(dense: dict) -> dict:
    """The dense methods every checkpoint's rounds time again: dense PyTorch and the routes with no comera, which
    each checkpoint's speeds are ratios against (the others are timed with the first checkpoint only)."""
    return {name: model for name, model in dense.items() if name == DENSE or name in zero_effort(dense)}


def _rounds_of(name: str, groups: list[dict]) -> dict[str, list[float]]:
    """The rounds of ``name`` and of every anchor, over the checkpoints' rounds that timed ``name``."""
    timed = [group for group in groups if name in group]
    return {method: [s for group in timed for s in group[method]] for method in timed[0] if method in timed[-1]}


def _scores(models: dict, domains: dict, first, progress) -> dict[str, dict]:
    """Retrieval scores per domain of each uncompiled method of ``models``."""
    scores = {}
    for index, (domain, pairs) in enumerate(domains.items()):
        progress(f"retrieval on {domain} ({index + 1}/{len(domains)}) of {len(models)} models")
        scores[domain] = {name: model_retrieval(model, first.tokenizer, pairs, SEQ_LEN, first.pooling)
                          for name, model in models.items() if not name.endswith(COMPILED)}
    return scores


def _graph_facts(model) -> dict:
    """What a row says of a method's model besides its timings: its graph's size, its layers' serving forms."""
    return {"file_mb": graph_megabytes(model), "forms": getattr(model, "forms", None)}


def _labelled(method: str, label: str) -> str:
    return f"{method} [{label}]" if label else method


def _label_of(method: str, labels: dict) -> str | None:
    """The checkpoint a method measures (its folder's name where several are measured), None for dense ones."""
    base = eager_name(method)
    for label in labels:
        if base.endswith(f" [{label}]") or (not label and base in COMPRESSED_METHODS):
            return label or None
    return None


def _check_one_source(checkpoints, compared) -> None:
    sources = {c.source for c in compared}
    if len(sources) > 1:
        recorded = ", ".join(f"{path} records {c.source!r}" for path, c in zip(checkpoints, compared))
        raise ConfigError(f"--checkpoint: the checkpoints measured side by side share one dense source: {recorded}")
    if compared[0].kind == "clm":
        raise ConfigError("--checkpoint measures sentence embedding: pass an encoder, not a causal LM")


def _pair_domains(pair_files, texts: int) -> dict:
    """Query/document pairs by domain: each of ``pair_files``, else the english corpus's held-out pairs."""
    domains = {}
    for file in pair_files:
        domains[pair_domain_name(file, domains)] = read_pairs(file, texts)
    return domains or {"english": held_out_pairs("english", texts)}


def _row(name: str, facts: dict, case: str, shape: str, per_second: float, against: dict, quality: dict,
         peer: str | None, checkpoint: str | None) -> dict:
    kept_by_domain = {domain: shares[name] for domain, shares in quality.items()}
    worst = min(kept_by_domain, key=lambda domain: kept_by_domain[domain]["recall_kept"])
    row = {"case": case, "method": name, "device": "cpu", "dtype": "int8" if "int8" in name else "float32",
           "shape": shape, **({"checkpoint": checkpoint} if checkpoint else {}),
           **{key: value for key, value in facts.items() if value},
           "sentences_per_s": round(per_second, 1), "speed_vs_dense": round(against["dense"][name][0], 2),
           "speed_vs_dense_error": round(against["dense"][name][1], 3),
           "recall_kept": {domain: round(share["recall_kept"], 3) for domain, share in kept_by_domain.items()},
           "recall_kept_error": {domain: round(share["recall_kept_error"], 3)
                                 for domain, share in kept_by_domain.items()},
           "worst_kept": round(kept_by_domain[worst]["recall_kept"], 3),
           "worst_kept_error": round(kept_by_domain[worst]["recall_kept_error"], 3)}
    if peer is not None:
        row.update({"speed_vs_peer": round(against["peer"][name][0], 2),
                    "speed_vs_peer_error": round(against["peer"][name][1], 3), "peer": peer})
    return row


def _runtimes(progress) -> list:
    """Each serving runtime's maker of methods and its (dense, compressed) method names: ONNX Runtime, and
    OpenVINO where it is installed."""
    runtimes = [(onnx_methods, ((DENSE_ONNX, DENSE_ONNX_INT8), (OURS_ONNX, OURS_ONNX_INT8)))]
    if openvino_installed():
        runtimes.append((openvino_methods, ((DENSE_OPENVINO, DENSE_OPENVINO_INT8),
                                            (OURS_OPENVINO, OURS_OPENVINO_INT8))))
    else:
        progress("no OpenVINO rows: pip install 'comera-convert[openvino]' to add them")
    return runtimes


def dense_runtime_methods(first, progress, peers) -> dict:
    """The dense model's ONNX Runtime methods, its OpenVINO ones where OpenVINO is installed, and the peers'
    graphs."""
    methods = {}
    for make, names in _runtimes(progress):
        methods.update(make(first.reference, names[0], first.tokenizer, progress))
    return methods | peer_methods(peers)


def needs_a_checkpoint(*_) -> list[dict]:
    """The serving case without a checkpoint: it measures a real one (``serving_case``)."""
    raise ConfigError("the serving case measures a real checkpoint: give --checkpoint PATH")


def interleaved(lists: list[list]) -> list:
    """The lists' items taken in turn (a1, b1, a2, b2, ...): a cut of it samples every list."""
    return [item for group in zip_longest(*lists) for item in group if item is not None]
