"""Rank-adaptive continued pre-training of compressed models (CoMERA), on transformers' Trainer.

options       TrainOptions: CoMERA's constants, validated (what recipes hold)
rank_control  model size from the gates, its surrogate, pruning, the two stages
budget        the late stage's size budget for --target-ratio
rank_cuts     closed ranks cut out of the cores (and AdamW's moments) while training
reprojection  --reproject: low-rank pairs rewritten in their inputs' ordered basis at each cut
objectives    mlm, clm, distill: heads, collators and the task loss
trainer       ComeraTrainer (optimizer groups, staged loss, truncated checkpoints, resume)
fsdp          --fsdp: FSDP2 sharding with whole gates, the gathered twin for saving, sharded AdamW state
plot          the loss / ratio curve as a PNG
attention     eager attention where a CPU trains under bf16 autocast
run           train(): load -> data -> Trainer -> export

``train`` and ``TrainResult`` load transformers' Trainer, so they are imported on first use:
reading the options (recipes, the CLI's choices) stays light.
"""

from __future__ import annotations

import importlib

from .options import TrainOptions

__all__ = ["TrainOptions", "TrainResult", "train"]


def __getattr__(name: str):
    if name in ("train", "TrainResult"):
        return getattr(importlib.import_module(".run", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
