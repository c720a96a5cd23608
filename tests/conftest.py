import os

# Tests never reach the Hugging Face Hub: models come from configs or the packaged MiniLM.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a forward pass compared with its dense twin, by dtype."""
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
