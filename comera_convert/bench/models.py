"""Model-level cases: a full training step (bert-base, or TinyLlama's 1.1 B shape), inference latency,
and conversion time (bert-base shapes).

Each training-step variant is saved to disk first, then loaded, timed and measured in a fresh
subprocess (``python -m comera_convert.bench.child``), so that its peak memory is its own: weights,
gradients, optimizer state and activations, above the process's memory after its imports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import comera_convert
from comera_convert.hf.saving import save_compressed
from comera_convert.models import auto_class_for, read_config

from ..errors import ConfigError, expected
from ..training.attention import use_training_attention
from ..training.options import TrainOptions
from ..training.plan import plan_training
from ..training.rank_control import RankController
from ..training.rank_cuts import cut_closed_ranks
from .timing import PeakMemory, graphed, median_seconds

# The TT variants' conversions: CoMERA's configuration (every linear tt at ranks 30, embeddings
# ttm at rank 30, as the comera-rank30 recipe), the same ranks with the converter's tt
# embeddings (whose tied head runs through the halves), and a default `--ratio 4` conversion.
# On CUDA also `--ratio 4 --rank-multiple 8`: ranks GPU tensor cores take whole (bf16 GEMMs).
TT_CONVERSIONS = {"TT comera r30": {"rank": 30, "embedding_layout": "ttm"},
                  "TT r30, tt embedding": {"rank": 30},
                  "TT --ratio 4": {"ratio": 4},
                  "TT --ratio 4, ranks of 8": {"ratio": 4, "rank_multiple": 8},
                  "TT --ratio 8, ranks of 8": {"ratio": 8, "rank_multiple": 8}}
# Variants whose ranks are cut as `comera train --target-ratio` cuts them (training/rank_cuts.py)
# once loaded: the budget closes gate entries down to the target ratio and the closed ones are cut
# out of the cores, so the step runs the shapes a rank-adaptive run ends with. Each is converted as
# its base variant (and shares its checkpoint).
RANK_CUT_TARGETS = {"TT --ratio 4 cut to 8x, ranks of 8": 8.0}
TT_CONVERSIONS["TT --ratio 4 cut to 8x, ranks of 8"] = TT_CONVERSIONS["TT --ratio 4, ranks of 8"]
# Conversions measured on CUDA only: aligned ranks change nothing in float32 or on the CPU.
CUDA_ONLY_CONVERSIONS = ("TT --ratio 4, ranks of 8", "TT --ratio 8, ranks of 8", "TT --ratio 4 cut to 8x, ranks of 8")
TRAIN_VARIANTS = ("dense AdamW", "GaLore AdamW r128",
                  *(name for name in TT_CONVERSIONS if name not in CUDA_ONLY_CONVERSIONS))
# On CUDA the whole step (forward, backward, AdamW) is also captured once and replayed as one CUDA graph.
GRAPH_SUFFIX = " + CUDA graph"
GRAPHED_VARIANTS = ("dense AdamW", *TT_CONVERSIONS)
# And compiled first (inductor fuses the elementwise work both models share, half of an eager bf16
# step at 1.1 B), then graphed: compiling takes one to two minutes a variant at 1.1 B, so a few.
COMPILED_SUFFIX = " + compile + CUDA graph"
COMPILED_VARIANTS = ("dense AdamW", "TT --ratio 4, ranks of 8", "TT --ratio 8, ranks of 8",
                     "TT --ratio 4 cut to 8x, ranks of 8")
# Activation checkpointing (transformers' gradient checkpointing, per layer): each layer's
# activations are recomputed in backward instead of kept, trading time for memory. Measured for
# the baselines too, so that each is compared with its own kind.
CHECKPOINT_SUFFIX = " + checkpointing"
CHECKPOINTED_VARIANTS = ("dense AdamW", "GaLore AdamW r128", "TT comera r30", "TT r30, tt embedding")


def split_variant(variant: str) -> tuple[str, str]:
    """(base variant, suffix): "TT comera r30 + checkpointing" -> ("TT comera r30", " + checkpointing")."""
    for suffix in (COMPILED_SUFFIX, GRAPH_SUFFIX, CHECKPOINT_SUFFIX):  # the longest first: both end in a graph
        if variant.endswith(suffix):
            return variant.removesuffix(suffix), suffix
    return variant, ""


# TinyLlama's shape: hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads (1.1 B
# parameters, its input and output embeddings untied).
LLAMA_1_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000)
LLAMA_QUICK = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=4096)


def bert_config(quick: bool):
    from transformers import BertConfig

    if quick:
        return BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
                          vocab_size=4096)
    return BertConfig()  # bert-base: 12 layers, 768 hidden, 3072 FFN, 30522 vocab


def training_model(name: str, quick: bool):
    """A randomly initialized ``name`` (one of TRAIN_MODELS) with its language-model head, tiny under
    ``quick``."""
    if name == "llama-1.1b":
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = LLAMA_QUICK if quick else LLAMA_1_1B
        return LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, **shape))
    from transformers import BertForMaskedLM

    return BertForMaskedLM(bert_config(quick))


def train_step_variants(device: str) -> list[str]:
    """Every variant the train-step case runs on ``device`` (graphed ones on CUDA only)."""
    variants = list(TRAIN_VARIANTS) + [v + CHECKPOINT_SUFFIX for v in CHECKPOINTED_VARIANTS]
    if device == "cuda":
        variants += [v + GRAPH_SUFFIX for v in GRAPHED_VARIANTS] + [v + COMPILED_SUFFIX for v in COMPILED_VARIANTS]
    return variants


def chosen_variants(device: str, wanted=None) -> list[str]:
    """The variants to run: all, or those ``wanted`` and the dense baselines they are compared with
    (plain dense, and dense run the same way: checkpointed or graphed)."""
    everything = train_step_variants(device)
    if not wanted:
        return everything
    unknown = [name for name in wanted if name not in everything]
    if unknown:
        names = ", ".join(repr(name) for name in everything)  # quoted: some names hold a comma
        raise ConfigError(expected(f"train-step variants on {device} among {names}", ", ".join(unknown)))
    baselines = {"dense AdamW"} | {"dense AdamW" + split_variant(name)[1] for name in wanted}
    return [v for v in everything if v in wanted or v in baselines]


def save_variants(directory: Path, quick: bool, bases=TRAIN_VARIANTS, model_name: str = "bert-base",
                  device: str = "cpu") -> dict[str, str]:
    """Random-weight checkpoints of the dense model and its TT conversions, by (base) variant, each
    initialized and converted on ``device`` (a 1.1 B model's TT-SVDs take seconds on a GPU)."""
    paths, saved = {}, {}
    for variant in bases:
        conversion = repr(TT_CONVERSIONS.get(variant))  # variants converted alike share one checkpoint
        if conversion in saved:
            paths[variant] = saved[conversion]
            continue
        torch.manual_seed(0)
        with torch.device(device):
            model = training_model(model_name, quick)
        path = directory / variant.replace(" ", "_").replace("-", "").replace(",", "")
        if variant in TT_CONVERSIONS:
            comera_convert.convert(model, uncalibrated=True, **TT_CONVERSIONS[variant])  # timed, not scored
            save_compressed(model, path, overwrite=True, replace_dir=True)
        else:
            model.save_pretrained(path)
        paths[variant] = saved[conversion] = str(path)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()  # the children measure on the same GPU
    return paths


def load_variant(variant: str, path: str, device: str, capturable: bool = False):
    """(model, optimizer) for one training-step variant, float32 weights (``capturable``: AdamW state
    on the device, as CUDA-graph capture needs)."""
    if variant in TT_CONVERSIONS:
        model = comera_convert.from_pretrained(path)
        if variant in RANK_CUT_TARGETS:
            cut_to_target(model.to(device), RANK_CUT_TARGETS[variant], TT_CONVERSIONS[variant].get("rank_multiple", 1))
    else:
        model = auto_class_for(read_config(path)).from_pretrained(path)  # the recorded architecture
    model.to(device).train()
    if variant.startswith("GaLore"):
        from galore_torch import GaLoreAdamW

        # GaLore projects the layers' matrices; the word table and the head train as usual.
        tables = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
        matrices = [p for p in model.parameters() if p.dim() == 2 and id(p) not in tables]
        ids = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if id(p) not in ids]
        # GaLore's README settings: rank 128, projection refreshed every 200 steps, scale 0.25.
        groups = [{"params": rest}, {"params": matrices, "rank": 128, "update_proj_gap": 200, "scale": 0.25,
                                      "proj_type": "std"}]
        return model, GaLoreAdamW(groups, lr=1e-4)
    # Fused AdamW for dense and TT alike (one kernel over all parameters, on CPU and CUDA): the
    # per-tensor step would flatter TT, whose dense baseline then spends 0.6 s per step in AdamW.
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=capturable)


def cut_to_target(model, target_ratio: float, rank_multiple: int) -> None:
    """Close the model's gate entries down to ``target_ratio`` as the end of a `--target-ratio` run's
    budget does (the least important first: all alike in an untrained model, so the last of each
    bond), then cut them out of the cores (``cut_closed_ranks``)."""
    steps = 100  # any: the budget is taken at its schedule's end
    options = plan_training(TrainOptions(steps=steps, target_ratio=target_ratio, rank_multiple=rank_multiple), "clm")
    controller = RankController(model, options, model.config.quantization_config.dense_params)
    controller.switch(0)
    controller.enforce_budget(steps)
    cut_closed_ranks(controller, None, steps)


def training_step(model, optimizer, ids, compute_dtype=torch.float32):
    """The measured step: a masked-LM loss on ``ids``, its backward and the optimizer's step. A
    ``compute_dtype`` other than float32 trains as `comera train --bf16` does: the weights and the
    optimizer state stay float32, the forward and the loss run under autocast."""

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(ids.device.type, compute_dtype, enabled=compute_dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
    return step


def train_step_child(variant: str, path: str, batch: int, seq: int, device: str, dtype_name: str,
                     repeats: int) -> dict:
    """One variant in a fresh process: its peak memory above the post-import baseline covers the
    weights, gradients, optimizer state and activations of training (in ``dtype_name`` under
    autocast, see ``training_step``: casting the weights would measure another training)."""
    compute_dtype = getattr(torch, dtype_name)
    base, suffix = split_variant(variant)
    with_graph = suffix in (GRAPH_SUFFIX, COMPILED_SUFFIX)
    with PeakMemory(device) as peak:
        model, optimizer = load_variant(base, path, device, capturable=with_graph)
        use_training_attention([model], cuda=device.startswith("cuda"), bf16=compute_dtype != torch.float32)
        if suffix == CHECKPOINT_SUFFIX:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
        step = training_step(torch.compile(model) if suffix == COMPILED_SUFFIX else model, optimizer, ids,
                             compute_dtype)
        if suffix == COMPILED_SUFFIX:
            step(), step()  # forward and backward compile here, untimed, before the graph's capture
        seconds = median_seconds(graphed(step) if with_graph else step, repeats, warmup=1, device=device)
    params = sum(p.numel() for p in model.parameters())
    return {"variant": variant, "seconds": seconds, "peak_bytes": peak.bytes, "params": params}


def train_step_case(device: str, dtype, quick: bool, repeats: int, progress=None, variants=None,
                    model_name: str = "bert-base") -> list[dict]:
    """``variants``: names to run (with their dense baselines); None runs every one. ``model_name``:
    one of TRAIN_MODELS."""
    progress = progress or (lambda message: None)
    seq = 32 if quick else 128
    # A full run measures a training batch and a single sequence; --quick one small batch (each
    # variant is a fresh process that imports torch and transformers: 4-6 s of a smoke run).
    batches = [2] if quick else ([32, 1] if device == "cuda" else [8, 1])
    variants = chosen_variants(device, variants)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = save_variants(Path(tmp), quick, dict.fromkeys(split_variant(v)[0] for v in variants), model_name,
                              device)
        for batch in batches:
            results = {}
            for number, variant in enumerate(variants, 1):
                progress(f"train-step, batch {batch}: {variant} ({number}/{len(variants)})")
                results[variant] = _run_child(variant, paths[split_variant(variant)[0]], batch, seq, device, dtype,
                                              repeats)
            shape = f"{'tiny ' if quick else ''}{model_name}, batch {batch} x seq {seq}"
            rows.extend(_train_rows(results, shape, batch * seq, device, dtype))
    return rows


def _train_rows(results: dict, shape: str, tokens: int, device: str, dtype) -> list[dict]:
    """Each variant against dense and GaLore run the same way (checkpointed with checkpointed, graphed
    with graphed), falling back to the plain baselines."""
    rows = []
    for variant, result in results.items():
        suffix = split_variant(variant)[1]
        dense = results.get("dense AdamW" + suffix, results["dense AdamW"])
        galore = results.get("GaLore AdamW r128" + suffix, results.get("GaLore AdamW r128"))
        row = {"case": "train-step", "method": variant, "device": device, "dtype": training_dtype_name(dtype),
               "shape": shape, "params": result.get("params")}
        if "error" in result or "error" in dense:
            rows.append({**row, "error": result.get("error") or dense.get("error")})
            continue
        row.update(ms=round(result["seconds"] * 1e3, 1), tokens_per_s=round(tokens / result["seconds"]),
                   peak_mb=round(result["peak_bytes"] / 2 ** 20, 1),
                   speed_vs_dense=round(dense["seconds"] / result["seconds"], 2),
                   memory_vs_dense=round(dense["peak_bytes"] / max(result["peak_bytes"], 1), 2))
        if galore and "error" not in galore:
            row.update(speed_vs_galore=round(galore["seconds"] / result["seconds"], 2),
                       memory_vs_galore=round(galore["peak_bytes"] / max(result["peak_bytes"], 1), 2))
        rows.append(row)
    return rows


def training_dtype_name(dtype) -> str:
    """How the train-step case trains in ``dtype``: "float32", or "bfloat16 autocast"."""
    name = str(dtype).replace("torch.", "")
    return name if dtype == torch.float32 else f"{name} autocast"


def _run_child(variant, path, batch, seq, device, dtype, repeats) -> dict:
    spec = json.dumps({"variant": variant, "path": path, "batch": batch, "seq": seq, "device": device,
                       "dtype_name": str(dtype).replace("torch.", ""), "repeats": repeats})
    done = subprocess.run([sys.executable, "-m", "comera_convert.bench.child", spec], capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": last[:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def inference_case(device: str, dtype, quick: bool, repeats: int) -> list[dict]:
    from transformers import BertModel

    seq = 32 if quick else 128
    torch.manual_seed(0)
    dense = BertModel(bert_config(quick)).to(device=device, dtype=dtype).eval()
    models = {"dense": dense}
    names = ["TT --ratio 4", "TT comera r30"] + (list(CUDA_ONLY_CONVERSIONS) if device == "cuda" else [])
    for name in names:  # no head here: the embedding's layout barely matters
        kwargs = TT_CONVERSIONS[name]
        model = BertModel(bert_config(quick)).to(device=device, dtype=dtype).eval()
        comera_convert.convert(model, uncalibrated=True, **kwargs)
        models[name] = model
    rows = []
    for batch in (1, 32):
        ids = torch.randint(0, dense.config.vocab_size, (batch, seq), device=device)
        times = {}
        with torch.no_grad():
            for name, model in models.items():
                times[name] = median_seconds(lambda m=model: m(input_ids=ids), repeats, device=device)
            if device == "cuda":  # launch-bound at batch 1: the forward replayed as one CUDA graph
                for name, model in list(models.items()):
                    replay = graphed(lambda m=model: m(input_ids=ids))
                    times[name + GRAPH_SUFFIX] = median_seconds(replay, repeats, device=device)
        for name, seconds in times.items():
            # Each against dense run the same way (eager with eager, graph with graph).
            dense_name = "dense" + GRAPH_SUFFIX if name.endswith(GRAPH_SUFFIX) else "dense"
            rows.append({"case": "inference", "method": name, "device": device,
                         "dtype": str(dtype).replace("torch.", ""), "shape": f"batch {batch} x seq {seq}",
                         "ms": round(seconds * 1e3, 2), "speed_vs_dense": round(times[dense_name] / seconds, 2)})
    return rows


def convert_case(device: str, dtype, quick: bool, repeats: int) -> list[dict]:
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "dense"
        BertForMaskedLM(bert_config(quick)).save_pretrained(source)

        def load_and_save():
            BertForMaskedLM.from_pretrained(source).save_pretrained(Path(tmp) / "copy")

        def convert_job():
            model = BertForMaskedLM.from_pretrained(source)
            comera_convert.convert(model, ratio=4, uncalibrated=True)
            save_compressed(model, Path(tmp) / "tt4", overwrite=True, replace_dir=True)

        baseline = median_seconds(load_and_save, repeats, warmup=1)
        ours = median_seconds(convert_job, repeats, warmup=1)
    return [{"case": "convert", "method": "load + save (transformers)", "device": "cpu", "dtype": "float32",
             "shape": "bert-base" if not quick else "tiny bert", "seconds": round(baseline, 2)},
            {"case": "convert", "method": "load + convert --ratio 4 + save", "device": "cpu", "dtype": "float32",
             "shape": "bert-base" if not quick else "tiny bert", "seconds": round(ours, 2),
             "time_vs_load_save": round(ours / baseline, 2)}]
