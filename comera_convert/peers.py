"""The peers a compressed model is compared with at equal bytes (`comera eval --baselines`): the
dense model rounded to fewer bits, every weight matrix (word table included) and its size in bytes.

  * bfloat16: the whole model stored in 16 bits (2x fewer bytes than float32);
  * int8, a float16 scale per row (``integer/``, what ``--dtype int8`` stores factors in): about 4x;
  * HQQ (Half-Quadratic Quantization, ``pip install hqq``; a well-kept library's optimized
    rounding with a scale and a zero point per group), 4 bits in groups of 64, 3 bits in groups of
    64, 2 bits in groups of 32: about 7x, 9x and 11x. Skipped, with a note, where hqq is missing.

Model2Vec, the static-embedding peer, is in ``evaluation.py`` (it needs distillation, not rounding).
Every peer is rounded in memory and run in float32: its quality is what its bytes would hold.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .integer import IntegerFormat, dequantize, quantize

HQQ_FORMATS = ((4, 64), (3, 64), (2, 32))  # (bits, group size): HQQ's own defaults span these
HQQ_MISSING = "HQQ peers skipped: pip install 'comera-convert[peers]'"


@dataclass
class Peer:
    """A dense model made smaller by rounding: the model (float32, rounded) and the bytes it stores."""

    label: str
    model: nn.Module
    stored_bytes: int


def weight_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every floating parameter with two or more axes (linears, embeddings), each shared one once."""
    return [(name, p) for name, p in model.named_parameters() if p.is_floating_point() and p.dim() >= 2]


def float_bytes(model: nn.Module, dtype_size: int = 4) -> int:
    """Bytes of the model's parameters in a float of ``dtype_size`` bytes, each shared tensor once."""
    return sum(p.numel() for p in model.parameters()) * dtype_size


def rounded_peer(reference: nn.Module, label: str, round_matrix, bytes_of) -> Peer:
    """A copy of ``reference`` whose weight matrices are ``round_matrix(rows x values)``, rows along
    the first axis; ``bytes_of(rows, values)`` what each stores. Vectors stay float32."""
    model = copy.deepcopy(reference).float()
    stored = float_bytes(model)
    with torch.no_grad():
        for _, param in weight_matrices(model):
            matrix = param.reshape(param.shape[0], -1)
            param.copy_(round_matrix(matrix).reshape(param.shape))
            stored += bytes_of(*matrix.shape) - matrix.numel() * 4
    return Peer(label, model, stored)


def integer_peer(reference: nn.Module, fmt: IntegerFormat, label: str) -> Peer:
    """Every weight matrix rounded to ``fmt`` with this project's rounding (``--dtype`` storage)."""
    def round_matrix(matrix):
        values, scales = quantize(matrix, fmt)
        return dequantize(values, scales, fmt, matrix.shape)

    return rounded_peer(reference, label, round_matrix, fmt.stored_bytes)


def hqq_peer(reference: nn.Module, bits: int, group: int) -> Peer:
    """Every weight matrix rounded by HQQ (asymmetric, a float16 scale and zero point per group,
    optimized by its half-quadratic solver); a width HQQ's group does not divide keeps one group a row."""
    from hqq.core.quantize import Quantizer

    def size(values: int) -> int:
        return group if values % group == 0 else values

    def round_matrix(matrix):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantized, meta = Quantizer.quantize(matrix.float(), nbits=bits, group_size=size(matrix.shape[1]),
                                                 axis=1, device="cpu", compute_dtype=torch.float32, bitpack=False)
            return Quantizer.dequantize(quantized, meta).reshape(matrix.shape)

    def bytes_of(rows: int, values: int) -> int:
        return math.ceil(rows * values * bits / 8) + rows * (values // size(values)) * 4  # scale and zero

    return rounded_peer(reference, f"HQQ {bits}-bit, groups of {group}", round_matrix, bytes_of)


def rounding_peers(reference: nn.Module) -> tuple[list[Peer], list[str]]:
    """The rounded peers of ``reference`` (module docstring), and notes on those skipped."""
    peers = [Peer("bfloat16 storage", copy.deepcopy(reference).to(torch.bfloat16), float_bytes(reference, 2)),
             integer_peer(reference, IntegerFormat(8), "int8, a scale per row")]
    try:
        import hqq.core.quantize  # noqa: F401
    except ImportError:
        return peers, [HQQ_MISSING]
    return peers + [hqq_peer(reference, bits, group) for bits, group in HQQ_FORMATS], []
