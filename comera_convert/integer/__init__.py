"""Integer storage of float tensors: symmetric rounding with a scale per channel or per group."""

from .rounding import IntegerFormat, dequantize, quantize

__all__ = ["IntegerFormat", "dequantize", "quantize"]
