"""int8 compute on a CPU: GEMMs run by torch's quantized kernels (fbgemm on x86, qnnpack on ARM).

A weight is rounded once, a scale per output channel, and packed for the kernel; each call rounds
its input to 8 bits with one scale for the whole tensor (dynamic quantization, the scheme of
``torch.ao.quantization.quantize_dynamic``), multiplies in integers and returns float32.
"""

from __future__ import annotations

import warnings

import torch

from ..errors import ConfigError, expected

# Engines whose packed linear runs the dynamic int8 GEMM ("x86" is fbgemm with oneDNN beside it).
INT8_ENGINES = ("x86", "fbgemm", "qnnpack")
# fbgemm's int8 products of two full-range bytes can overflow its 16-bit accumulation; rounding the
# input to 7 bits avoids it (quantize_dynamic's default on x86, harmless on ARM).
REDUCE_RANGE = True


def int8_engine() -> str:
    """The quantized engine int8 GEMMs run on here (made torch's quantized backend), or a one-line
    error naming what this torch lacks."""
    if not has_int8_ops():
        raise ConfigError(f"int8 compute needs torch's quantized linear operators, which torch {torch.__version__} "
                          "does not have: run the model in float32")
    supported = supported_engines()
    if torch.backends.quantized.engine in INT8_ENGINES:
        return torch.backends.quantized.engine
    for engine in INT8_ENGINES:
        if engine in supported:
            torch.backends.quantized.engine = engine
            return engine
    raise ConfigError(expected(f"a torch build with int8 GEMM kernels (quantized engines {', '.join(INT8_ENGINES)})",
                               f"engines {', '.join(supported) or 'none'}"))


def has_int8_ops() -> bool:
    """Whether this torch has the packed dynamic int8 linear (deprecated in recent releases)."""
    return all(hasattr(torch.ops.quantized, name) for name in ("linear_prepack", "linear_dynamic"))


def supported_engines() -> list[str]:
    """The quantized engines this torch build was compiled with."""
    return [engine for engine in torch.backends.quantized.supported_engines if engine != "none"]


def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``weight`` (out x in) rounded to int8 with a scale per output row, and packed with ``bias``
    for ``int8_linear``."""
    int8_engine()
    weight = weight.detach().float().contiguous()
    # An all-zero row (a closed rank) keeps a tiny scale: it rounds to zeros, never divides by zero.
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch announces the quantized tensor API's deprecation on every call
        warnings.simplefilter("ignore", UserWarning)
        rounded = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(rounded, None if bias is None else bias.detach().float())


def int8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """``x @ W.T + b`` (x: tokens x in, float32) through the packed int8 weight."""
    return torch.ops.quantized.linear_dynamic(x, packed, REDUCE_RANGE)


def balance_bond(left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same product ``left @ right`` with every column of ``left`` of unit norm (the scale moved
    into ``right``'s rows): the bond's activations ``x @ left`` then share one range, which the
    per-tensor rounding of the second GEMM's input needs. See BENCHMARKS.md#serving-on-a-cpu."""
    norms = left.norm(dim=0).clamp_min(1e-12)
    return left / norms, right * norms[:, None]
