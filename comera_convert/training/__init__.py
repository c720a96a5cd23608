"""Rank-adaptive continued pre-training of compressed models (CoMERA), on transformers' Trainer.

options       TrainOptions: CoMERA's constants, validated (what recipes hold)
rank_control  model size from the gates, its surrogate, pruning, the two stages
data          text sources and the built-in python-stdlib corpus; packing into blocks
objectives    mlm, clm, distill: heads, collators and the task loss
trainer       ComeraTrainer (optimizer groups, staged loss, truncated checkpoints, resume)
plot          the loss / ratio curve as a PNG
run           train(): load -> data -> Trainer -> export
"""

from .options import TrainOptions
from .run import TrainResult, train

__all__ = ["TrainOptions", "TrainResult", "train"]
