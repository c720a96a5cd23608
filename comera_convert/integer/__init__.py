"""Integer storage of float tensors: symmetric rounding with a scale per channel or per group."""

from .rounding import IntegerFormat, dequantize, fake_quantize, quantize

__all__ = ["IntegerFormat", "dequantize", "fake_quantize", "quantize"]
