"""Embedding throughput of a real checkpoint on a CPU, beside its dense source and the peers a deployer
tries first, with the quality each keeps (`comera bench inference --checkpoint PATH`).

Methods: the dense model; the dense model with its linears in int8 (torch's dynamic quantization,
``quantize_dynamic``); the compressed model in float32; the compressed model with int8 compute
(``layers.use_int8_compute``); with ``compile_models``, each of the four under ``torch.compile`` as
well (inductor fuses the elementwise work between the GEMMs and takes away Python's per-layer
overhead; the int8 GEMMs stay torch's quantized kernels; compiling happens in the untimed
warm-up). Texts are embedded as sentence-transformers' ``encode`` does: sorted by length, in
batches of ``BATCH``. Each timed round runs every method once, in turn, and each method reports its
median round (rounds side by side: the machine's drift meets every method alike).
Quality: each method's retrieval recall@1 on query/document pairs as a share of the dense model's (a
compiled method is scored as its eager source).
"""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import time
import warnings
from itertools import zip_longest

import torch

from ..errors import ConfigError
from ..evaluation import load_compared, pair_domain_name
from ..hf.openvino_export import openvino_installed
from ..layers import use_int8_compute
from ..retrieval import held_out_pairs, kept, model_retrieval, read_pairs
from .onnx_serving import graph_megabytes, onnx_methods, peer_methods
from .openvino_serving import openvino_methods

BATCH = 32  # sentence-transformers' default encode batch
SEQ_LEN = 256  # tokens a text is cut to (the longest MiniLM and MPNet sentence models embed)
DENSE, DENSE_INT8, OURS, OURS_INT8 = ("dense", "dense, int8 dynamic (torch)", "comera float32", "comera int8 compute")
COMPILED = ", torch.compile"  # the suffix of a compiled method's name


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


def timed_rounds(models: dict, batches: list[dict], repeats: int) -> dict[str, float]:
    """Median seconds of one pass over ``batches`` per model, the models taking turns each round."""
    for model in models.values():  # warm-up: first-call allocations and packing
        _embed_all(model, batches[:2])
    rounds = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            _embed_all(model, batches)
            rounds[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in rounds.items()}


def serving_case(checkpoint: str, reference_name: str | None, pair_files, texts: int, repeats: int,
                 progress=None, compile_models: bool = False, onnx: bool = False, peers=(),
                 batch: int = BATCH) -> list[dict]:
    """One row per method: sentences a second, speed against dense, and recall@1 kept per pair domain
    (each of ``pair_files``, else the built-in english corpus's held-out pairs) with its standard
    error; ``compile_models`` adds each method under ``torch.compile``, ``onnx`` the dense and the
    compressed model in ONNX Runtime and, where it is installed, OpenVINO, float and int8, and each graph of
    ``peers`` (``onnx_serving.py``, ``openvino_serving.py``);
    texts are embedded ``batch`` at a time (1: one request at a time, as an online service embeds)."""
    progress = progress or (lambda message: None)
    if compile_models:
        require_cpp_compiler()
    compared = load_compared(checkpoint, reference_name, "comera bench", progress)
    if compared.kind == "clm":
        raise ConfigError("--checkpoint measures sentence embedding: pass an encoder, not a causal LM")
    progress("int8 copies of the dense and compressed models")
    models = {DENSE: compared.reference, DENSE_INT8: quantized_dense(compared.reference), OURS: compared.compressed,
              OURS_INT8: int8_compute_copy(compared.compressed)}
    if compile_models:
        models.update({name + COMPILED: compiled(model) for name, model in list(models.items())})
    if onnx:
        models.update(runtime_methods(compared, progress, peers))
    domains = _pair_domains(pair_files, texts)
    documents = interleaved([[document for _, document in pairs] for pairs in domains.values()])[:texts]
    batches = length_sorted_batches(compared.tokenizer, documents, batch)
    progress(f"timing {len(documents)} texts, {repeats} rounds of {len(models)} models"
             + (" (compiling first)" if compile_models else ""))
    seconds = timed_rounds(models, batches, repeats)
    quality = {}
    for index, (domain, pairs) in enumerate(domains.items()):
        progress(f"retrieval on {domain} ({index + 1}/{len(domains)})")
        scores = {name: model_retrieval(model, compared.tokenizer, pairs, SEQ_LEN, compared.pooling)
                  for name, model in models.items() if not name.endswith(COMPILED)}
        quality[domain] = {name: kept(scores[eager_name(name)], scores[DENSE]) for name in models}
    tokens = sum(int(encoded["attention_mask"].sum()) for encoded in batches)
    shape = f"{compared.source}, {len(documents)} texts ({tokens / len(documents):.0f} tokens avg), batch {batch}"
    return [_row(name, models[name], "serving" if onnx else "inference", shape, len(documents) / seconds[name],
                 seconds[DENSE] / seconds[name], quality) for name in models]


def _pair_domains(pair_files, texts: int) -> dict:
    """Query/document pairs by domain: each of ``pair_files``, else the english corpus's held-out pairs."""
    domains = {}
    for file in pair_files:
        domains[pair_domain_name(file, domains)] = read_pairs(file, texts)
    return domains or {"english": held_out_pairs("english", texts)}


def _row(name: str, model, case: str, shape: str, per_second: float, speed: float, quality: dict) -> dict:
    return {"case": case, "method": name, "device": "cpu", "dtype": "int8" if "int8" in name else "float32",
            "shape": shape, **({"file_mb": megabytes} if (megabytes := graph_megabytes(model)) else {}),
            "sentences_per_s": round(per_second, 1), "speed_vs_dense": round(speed, 2),
            "recall_kept": {domain: round(shares[name]["recall_kept"], 3) for domain, shares in quality.items()},
            "recall_kept_error": {domain: round(shares[name]["recall_kept_error"], 3)
                                  for domain, shares in quality.items()}}


def runtime_methods(compared, progress, peers) -> dict:
    """The ONNX Runtime methods, the OpenVINO ones where OpenVINO is installed, and the peers' graphs."""
    methods = onnx_methods(compared.reference, compared.compressed, compared.tokenizer, progress)
    if openvino_installed():
        methods.update(openvino_methods(compared.reference, compared.compressed, compared.tokenizer, progress))
    else:
        progress("no OpenVINO rows: pip install 'comera-convert[openvino]' to add them")
    return methods | peer_methods(peers)


def needs_a_checkpoint(*_) -> list[dict]:
    """The serving case without a checkpoint: it measures a real one (``serving_case``)."""
    raise ConfigError("the serving case measures a real checkpoint: give --checkpoint PATH")


def interleaved(lists: list[list]) -> list:
    """The lists' items taken in turn (a1, b1, a2, b2, ...): a cut of it samples every list."""
    return [item for group in zip_longest(*lists) for item in group if item is not None]
