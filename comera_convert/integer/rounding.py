"""Symmetric integer rounding of a tensor, a scale per channel or per group of a channel's values.

A tensor is read as channels (one axis) of ``width`` values each (every other axis, flattened).
Each group of ``group_size`` consecutive values of a channel (the whole channel without a group
size) gets one scale s, and each value x is stored as q = round(x / s), clamped to the format's
range: -127..127 for int8, -7..7 for int4 (two values per byte, low nibble first), -3..3 and -1..1
for 3 and 2 bits (held a byte each: rounding measured, never stored); a tensor's
scales say how its channels were grouped, so reading needs no group size. s is chosen
by a small search (the clip search of AWQ and OmniQuant): s = shrink * max|x| / q_max for the
shrink in ``SHRINKS`` whose rounding error over the group is least; clipping the largest values a
little buys finer steps for all the others. A model trained on the rounded values (``fake_quantize``)
is rounded with s = max|x| / q_max, the grid it trained on. Scales are stored in float16 (GPTQ and
AWQ do too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError, ModelLoadError, expected

# Bits a value can be rounded to; checkpoints store 8 and 4 (two a byte), 3 and 2 are for
# measuring rounding as a peer (`comera eval --baselines`).
BITS = (8, 4, 3, 2)
# Shrinks of the largest magnitude tried as the clipping level of each group (1.0: no clipping); the
# search lowers the rounding error, most in int4 (docs/findings.md).
SHRINKS = tuple(1.0 - 0.05 * k for k in range(11))
SCALE_DTYPE = torch.float16


# A channel whose width no group size up to the requested one divides into groups of at least this
# many values gets one scale for the whole channel (smaller groups would spend more on scales).
MIN_GROUP_SIZE = 16


@dataclass(frozen=True)
class IntegerFormat:
    """How a tensor is stored: ``bits`` per value, a scale per ``group_size`` values of a channel
    (None: one scale per channel). ``exact``: a group size that does not divide a channel's width is
    an error; otherwise that channel gets the fewest groups of at most ``group_size`` values that
    divide it evenly (the default group size, so that every width stores)."""

    bits: int
    group_size: int | None = None
    exact: bool = True
    # Each group's scale by the clip search (below); False: its largest magnitude, as
    # quantization-aware training rounds (``fake_quantize``), so that a model trained on that grid
    # is written on it.
    clip_search: bool = True

    def __post_init__(self):
        if self.bits not in BITS:
            raise ConfigError(expected(f"integer bits in {BITS}", self.bits))
        size = self.group_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 2 or size % 2):
            raise ConfigError(expected("a group size as an even integer of 2 or more (values per scale)", size))

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def largest(self) -> int:
        """The largest stored magnitude: 127 (int8), 7 (int4)."""
        return 2 ** (self.bits - 1) - 1

    def groups(self, width: int, what: str) -> int:
        """Groups per channel of ``width`` values (class docstring); an exact group size that does
        not divide the width is refused."""
        size = self.group_size
        if size is None or width % size == 0:
            return 1 if size is None else width // size
        if self.exact:
            raise ConfigError(f"{self.name} group size {size} does not divide the width {width} of {what} "
                              f"(values per channel): choose a group size that divides {width}")
        for count in range(math.ceil(width / size), width // MIN_GROUP_SIZE + 1):
            if width % count == 0:
                return count
        return 1

    def stored_bytes(self, channels: int, width: int) -> int:
        """Bytes of a (channels x width) tensor stored in this format: its values, bits / 8 bytes
        each, and a float16 scale per group."""
        return math.ceil(channels * width * self.bits / 8) + channels * self.groups(width, "a tensor") * 2


def channels_first(tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """``tensor`` as a (channels x width) matrix: ``axis`` first, every other axis flattened."""
    return tensor.movedim(axis, 0).reshape(tensor.shape[axis], -1)


def channels_back(matrix: torch.Tensor, shape, axis: int) -> torch.Tensor:
    """The inverse of ``channels_first``: a (channels x ...) tensor back to ``shape``, its channels
    along ``axis``."""
    moved = [shape[axis]] + [size for i, size in enumerate(shape) if i != axis]
    return matrix.reshape(moved).movedim(0, axis)


def _grouped(tensor: torch.Tensor, fmt: IntegerFormat, axis: int, what: str) -> torch.Tensor:
    """``tensor`` as (channels x groups x group size) float32 values (``channels_first``, grouped)."""
    matrix = channels_first(tensor.detach(), axis).float()
    channels, width = matrix.shape
    return matrix.reshape(channels, fmt.groups(width, what), -1)


def _best_scales(grouped: torch.Tensor, fmt: IntegerFormat, shrinks: tuple[float, ...]) -> torch.Tensor:
    """Each group's scale (channels x groups x 1, float16 values held in float32): of the shrinks of
    its largest magnitude, the one whose rounding errs least (module docstring)."""
    peak = grouped.abs().amax(-1, keepdim=True)
    best_scale = best_error = None
    for shrink in shrinks:
        scale = (peak * shrink / fmt.largest).to(SCALE_DTYPE).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group (or one below float16)
        if len(shrinks) == 1:
            return scale
        error = (_rounded(grouped, scale, fmt) * scale - grouped).square().sum(-1, keepdim=True)
        if best_error is None:
            best_scale, best_error = scale, error
        else:
            better = error < best_error
            best_scale, best_error = torch.where(better, scale, best_scale), torch.minimum(error, best_error)
    return best_scale


@torch.no_grad()
def quantize(tensor: torch.Tensor, fmt: IntegerFormat, axis: int = 0,
             what: str = "the tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of ``tensor`` rounded to ``fmt`` with channels along ``axis``: int8 values
    (channels x width), or for int4 uint8 bytes of two values each (channels x width / 2); float16
    scales (channels x groups), by the clip search unless ``fmt`` says otherwise (module
    docstring). NaN or infinite entries are refused."""
    grouped = _grouped(tensor, fmt, axis, what)
    if not torch.isfinite(grouped).all():
        raise ConfigError(f"{what} holds NaN or infinite values: it cannot be stored as {fmt.name}")
    scales = _best_scales(grouped, fmt, SHRINKS if fmt.clip_search else (1.0,))
    values = _rounded(grouped, scales, fmt).reshape(grouped.shape[0], -1).to(torch.int8)
    scales = scales.reshape(grouped.shape[0], -1).to(SCALE_DTYPE)
    return (pack_int4(values) if fmt.bits == 4 else values), scales  # 3 and 2 bits: one a byte, unpacked


def _rounded(grouped: torch.Tensor, scale: torch.Tensor, fmt: IntegerFormat) -> torch.Tensor:
    return torch.round(grouped / scale).clamp_(-fmt.largest, fmt.largest)


def dequantize(values: torch.Tensor, scales: torch.Tensor, fmt: IntegerFormat, shape, axis: int = 0,
               dtype: torch.dtype = torch.float32, what: str = "the tensor") -> torch.Tensor:
    """The tensor of ``shape`` that ``quantize`` stored as (values, scales), in ``dtype``. A scale
    that is zero, negative or not finite (``quantize`` never writes one) is refused."""
    if not (torch.isfinite(scales).all() and (scales > 0).all()):
        raise ModelLoadError(f"{what} has a scale that is zero, negative or not finite: the checkpoint is damaged")
    shape = tuple(shape)
    channels = shape[axis]
    width = (torch.Size(shape).numel() // channels) if channels else 0
    ints = unpack_int4(values) if fmt.bits == 4 else values
    groups = scales.shape[1] if scales.dim() == 2 else 0
    if tuple(ints.shape) != (channels, width) or scales.shape[0] != channels or not groups or width % groups:
        raise ModelLoadError(f"{what} is stored as {tuple(values.shape)} values and {tuple(scales.shape)} scales, "
                             f"which do not make a {fmt.name} tensor of shape {shape}")
    grouped = ints.float().reshape(channels, groups, -1) * scales.float().unsqueeze(-1)
    return channels_back(grouped, shape, axis).to(dtype).contiguous()


def fake_quantize(tensor: torch.Tensor, fmt: IntegerFormat, axis: int = 0) -> torch.Tensor:
    """``tensor`` rounded as ``fmt`` stores it, passing gradients through as if it were not (the
    straight-through estimator of quantization-aware training): training then moves the values the
    rounding keeps. Each group's largest magnitude sets its scale (no clip search: it runs every
    step), and nothing is packed or checked: the values never leave memory."""
    with torch.no_grad():
        grouped = _grouped(tensor, fmt, axis, "a tensor")
        scales = _best_scales(grouped, fmt, (1.0,))
        rounded = channels_back(_rounded(grouped, scales, fmt) * scales, tensor.shape, axis).to(tensor.dtype)
    return tensor + (rounded - tensor).detach()


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pairs of int4 values (-8..7) along the last axis as one byte each, the first in the low nibble."""
    nibbles = (values.to(torch.int16) & 0xF).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The int8 values ``pack_int4`` packed, twice as many along the last axis."""
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    both = torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1)
    return torch.where(both > 7, both - 16, both)
