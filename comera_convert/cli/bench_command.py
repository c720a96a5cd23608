"""`comera bench`: speed and memory of TT against dense (and peers), as ratios from one run."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .group import main
from ..choices import BENCH_CASES as CASE_NAMES, CHECKPOINT_CASES, FORM_REQUESTS, TRAIN_MODELS
from .console import console, echo_json, progress_display

COLUMNS = ("method", "checkpoint", "shape", "tokens", "ranks", "params_ratio", "flop_ratio", "speedup",
           "speedup_per_flop_ratio", "graph_speedup", "graph_speedup_per_flop_ratio",
           "ms", "seconds", "tokens_per_s", "sentences_per_s", "peak_mb", "speed_vs_dense", "speed_vs_peer",
           "memory_vs_dense", "speed_vs_galore", "memory_vs_galore", "time_vs_load_save", "file_mb", "recall_kept",
           "recall_kept_error", "worst_kept", "error")


@main.command()
@click.argument("cases", nargs=-1, type=click.Choice(CASE_NAMES))
@click.option("--quick", is_flag=True, help="Tiny shapes and few repeats: a smoke test, not a measurement.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              help="Weights and inputs in this dtype; train-step keeps float32 weights and runs bfloat16 "
                   "under autocast, as comera train --bf16 does.")
@click.option("--repeats", type=int, default=None, help="Timed runs per measurement (median) [default: 5, quick 2].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), is_flag=False, flag_value="-",
              default=None, help="Write the rows as JSON to this file; alone, print them instead of tables.")
@click.option("--variant", "variants", multiple=True, metavar="NAME",
              help="train-step: run only this variant and the dense baselines it is compared with "
                   "(repeatable), e.g. --variant 'TT --ratio 4 + CUDA graph'.")
@click.option("--model", "model_name", type=click.Choice(TRAIN_MODELS), default="bert-base", show_default=True,
              help="train-step: the model whose step is timed, random weights: bert-base as a masked LM, or "
                   "TinyLlama's 1.1 B shape as a causal LM (GPU-sized: about 18 GB of float32 weights, "
                   "gradients and AdamW state).")
@click.option("--checkpoint", "checkpoints", metavar="PATH", multiple=True,
              help="inference: a real compressed encoder's sentences a second on the CPU, beside its dense "
                   "source, int8 dynamic quantization of the dense model and int8 compute of its own, each "
                   "with its retrieval recall@1 kept (instead of random bert-base); serving: the same, and "
                   "both models in ONNX Runtime and OpenVINO, float and int8 as sentence-transformers "
                   "quantizes (needs them). Repeatable: checkpoints of one source side by side, as a frontier.")
@click.option("--reference", metavar="NAME", help="--checkpoint: the dense model [default: its recorded source].")
@click.option("--pairs", "pair_files", multiple=True, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="--checkpoint: JSONL query/document pairs, a domain each (repeatable) [default: held-out "
                   "pairs of the english corpus].")
@click.option("--texts", type=click.IntRange(min=2), default=512, show_default=True,
              help="--checkpoint: texts embedded per timed round, and pairs per domain.")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="--checkpoint: texts embedded at a time, 1 for one request at a time [default: 32, "
                   "sentence-transformers' encode batch].")
@click.option("--peer", "peers", multiple=True, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="serving: a graph made elsewhere to time and score beside the others (repeatable): an .onnx "
                   "file runs in ONNX Runtime, an OpenVINO .xml in OpenVINO; e.g. sentence-transformers' own int8 "
                   "exports of the dense model.")
@click.option("--forms", type=click.Choice(FORM_REQUESTS), default="auto", show_default=True,
              help="serving: the compressed graphs' pairs as two products or multiplied out, each layer in int8 "
                   "or float: timed on this machine (auto), or one form for every pair (comera export --forms).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, metavar="PNG",
              help="serving: each method's speed against the fastest route that needs no comera (sentence-"
                   "transformers' exports, --peer) beside the worst domain's share of recall@1 kept, as a plot.")
@click.option("--compile", "compile_models", is_flag=True,
              help="--checkpoint: also time each method under torch.compile (compiled in the untimed "
                   "warm-up; needs a C++ compiler).")
def bench(cases, quick, device, dtype, repeats, json_path, variants, model_name, checkpoints, reference, pair_files,
          texts, batch, peers, forms, plot, compile_models):
    """Measure CASES (default: all but serving): layer, embedding, train-step, convert, inference, serving."""
    import torch

    from .render import fitted

    from .. import bench as benchmarks
    from ..hf.files import write_text_atomic

    if device == "auto":  # a checkpoint's serving is measured on the CPU, where int8 kernels run
        device = "cuda" if torch.cuda.is_available() and not checkpoints else "cpu"
    cases = cases or tuple(name for name in CASE_NAMES if name != "serving")
    _check_cases(cases, device, variants, model_name, checkpoints, plot)
    serving = _serving_request(cases, device, checkpoints, reference, pair_files, texts, batch, peers,
                               compile_models, forms)
    repeats = repeats or (2 if quick else 5)
    out = console()
    with progress_display() as update:
        def progress(message: str) -> None:
            update(f"bench: {message}")
            # A log file: one line per step, so a run cut short shows how far it got (not into --json's stdout).
            if not out.is_terminal and json_path != "-":
                out.print(f"bench: {message}", highlight=False)

        rows = benchmarks.run(cases, device, getattr(torch, dtype), quick, repeats, progress, variants or None,
                              model_name, serving)
    payload = {"machine": benchmarks.machine(), "torch": torch.__version__, "device": device,
               "dtype": dtype, "quick": quick, "rows": rows}
    if json_path and json_path != "-":  # the measurement first: nothing after it may lose it
        write_text_atomic(Path(json_path), json.dumps(payload, indent=1))
    if plot:
        from ..bench.serving_plot import plot_serving

        plot_serving([r for r in rows if r["case"] == "serving"], Path(plot), benchmarks.machine())
    if json_path == "-":
        echo_json(payload)
        return
    autocast = " (train-step: float32 weights under autocast)" if dtype != "float32" and "train-step" in cases else ""
    out.print(f"machine: {benchmarks.machine()}, torch {torch.__version__}, {device}, {dtype}{autocast}"
              + (" (--quick: smoke test)" if quick else ""), soft_wrap=True)
    for case in dict.fromkeys(r["case"] for r in rows):
        case_rows = [r for r in rows if r["case"] == case]
        columns = [c for c in COLUMNS if any(c in r for r in case_rows)]
        justify = [(c, "left" if c in ("method", "shape", "ranks", "error") else "right") for c in columns]
        out.print(fitted(case, justify, [[_cell(row.get(c)) for c in columns] for row in case_rows], out.width))
    if json_path:
        out.print(f"[green]wrote[/] {json_path}")
    if plot:
        out.print(f"[green]wrote[/] {plot}")


def _check_cases(cases, device: str, variants, model_name: str, checkpoints, plot=None) -> None:
    """Refuse, before anything is measured, options that do not go with the chosen cases."""
    import torch

    from ..bench.models import chosen_variants
    from ..errors import ConfigError

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here")
    if "serving" in cases and not checkpoints:
        raise ConfigError("the serving case measures a real checkpoint: give --checkpoint PATH")
    if plot and "serving" not in cases:
        raise ConfigError(f"--plot draws the serving case, and the cases are {', '.join(cases)}")
    if variants:
        if "train-step" not in cases:
            raise ConfigError(f"--variant chooses train-step variants, and the cases are {', '.join(cases)}")
        chosen_variants(device, variants)  # an unknown name fails now, not after the other cases
    if model_name != "bert-base" and "train-step" not in cases:
        raise ConfigError(f"--model chooses the train-step model, and the cases are {', '.join(cases)}")


def _serving_request(cases, device: str, checkpoints, reference, pair_files, texts, batch, peers,
                     compile_models, forms: str = "auto") -> dict | None:
    """The checkpoint cases' keyword arguments (``bench.serving.serving_case``), None without --checkpoint."""
    from ..bench.serving import BATCH
    from ..errors import ConfigError

    if not checkpoints:
        if reference or pair_files or compile_models or peers or batch:
            raise ConfigError("--reference, --pairs, --batch, --compile and --peer go with --checkpoint")
        return None
    if not set(CHECKPOINT_CASES) & set(cases):
        raise ConfigError(f"--checkpoint measures the inference and serving cases, and the cases are "
                          f"{', '.join(cases)}")
    if device != "cpu":
        raise ConfigError(f"--checkpoint measures CPU serving (int8 kernels run on the CPU), not --device {device}")
    if peers and "serving" not in cases:
        raise ConfigError("--peer adds a graph to the serving case, and the cases are " + ", ".join(cases))
    return {"checkpoint": list(checkpoints), "reference_name": reference, "pair_files": pair_files, "texts": texts,
            "compile_models": compile_models, "peers": peers, "batch": batch or BATCH, "forms": forms}


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, dict):  # recall kept by domain, and its standard error
        return ", ".join(f"{key} {item}" for key, item in value.items())
    return str(value)
