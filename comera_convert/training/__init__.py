"""Rank-adaptive continued pre-training of compressed models (CoMERA), on transformers' Trainer.

options       TrainOptions: what a run should do, validated (what recipes hold); CoMERA's constants
plan          plan_training(request, objective): every default by objective, target and cut, with its reason
rank_control  model size from the gates, its surrogate, closing gates, the staged loss
stages        when the stages run and the late stage's budget schedule
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
from .plan import TrainPlan, plan_training

__all__ = ["TrainOptions", "TrainPlan", "TrainResult", "plan_training", "train"]


def __getattr__(name: str):
    if name in ("train", "TrainResult"):
        return getattr(importlib.import_module(".run", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
