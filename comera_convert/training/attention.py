"""The attention implementation a training run computes with (apart from run.py, so that
`comera bench` children use it without importing transformers' Trainer)."""

from __future__ import annotations


def use_training_attention(models, cuda: bool, bf16: bool) -> None:
    """Eager attention for the models a CPU run under bf16 autocast trains and distills from (the
    loaded models keep theirs elsewhere; the checkpoints written do not record it). torch's CPU
    flash-attention backward in bfloat16 is slow at these shapes: the --ratio 4 MiniLM's forward and
    backward at batch 8 x 128 took 176-182 ms with eager attention against 262-292 ms with sdpa
    (float32 level), and five minutes of the train-minilm-distill recipe ran 710 steps instead of
    647 (docs/findings.md)."""
    if cuda or not bf16:
        return
    for model in models:
        if model is not None:
            model.set_attn_implementation("eager")
