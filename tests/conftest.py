import logging
import os

# Tests never reach the Hugging Face Hub: models come from configs or the packaged MiniLM.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _library_logger():
    """Each test starts with the library logger as Python leaves it (no handler, propagating): the
    CLI routes it to its console and stops propagation, which would hide its records from caplog
    in every test after the first CLI call, fixtures' calls included."""
    logger = logging.getLogger("comera_convert")
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a forward pass compared with its dense twin, by dtype."""
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
