"""comera_convert: tensor-train compression and rank-adaptive training of Hugging Face models."""

__version__ = "0.1.0"

from .errors import ComeraError  # noqa: E402
from .layers import TTEmbedding, TTLinear, TTModule  # noqa: E402

__all__ = ["ComeraError", "TTEmbedding", "TTLinear", "TTModule", "__version__"]
