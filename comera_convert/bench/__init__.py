"""`comera bench`: measured side by side in one run, as ratios; never asserted in tests.

timing   medians after warm-up (CUDA events), peak memory (CUDA allocator, or CPU peak RSS)
layers   TTLinear vs nn.Linear vs tensorly-torch; TTEmbedding vs nn.Embedding vs a naive lookup
models   a training step (bert-base or a 1.1 B Llama; dense, GaLore, TT), inference, conversion time
serving  a real checkpoint's embedding throughput and quality against dense and int8 rounding
onnx_serving  the same checkpoint and its dense source in ONNX Runtime, float and int8; graphs made elsewhere
openvino_serving  the same in OpenVINO
child    one training-step variant in a fresh process
"""

from __future__ import annotations

import functools

import torch

from ..choices import CHECKPOINT_CASES
from ..machine import cpu_model
from .layers import embedding_case, layer_case
from .models import convert_case, inference_case, train_step_case
from .serving import needs_a_checkpoint, serving_case

CASES = {"layer": layer_case, "embedding": embedding_case, "train-step": train_step_case,
         "convert": convert_case, "inference": inference_case, "serving": needs_a_checkpoint}


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def run(cases, device: str, dtype: torch.dtype, quick: bool, repeats: int, progress=None,
        variants=None, model_name: str = "bert-base", serving: dict | None = None) -> list[dict]:
    """The rows of each case in turn; ``progress(message)`` hears of each case, and of each variant of
    the training step (minutes: one fresh process per variant); ``variants`` limits the training
    step to those names and their dense baselines; ``model_name`` is the model whose training step
    is timed (one of ``models.TRAIN_MODELS``). ``serving``: the inference case measures this real
    checkpoint instead, and the serving case measures it in ONNX Runtime as well (``serving_case``'s
    keyword arguments: checkpoint, reference_name, pair_files, texts, compile_models, peers, batch)."""
    progress = progress or (lambda message: None)
    rows = []
    for name in cases:
        progress(name)
        if name in CHECKPOINT_CASES and serving:
            rows.extend(serving_case(**serving, repeats=repeats, progress=progress, onnx=name == "serving"))
            continue
        case = CASES[name]
        if name == "train-step":
            case = functools.partial(case, progress=progress, variants=variants, model_name=model_name)
        rows.extend(case(device, dtype, quick, repeats))
    return rows
