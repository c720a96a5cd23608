"""nn.Modules over the TT math: thin wrappers that hold cores and rank gates."""

from .base import TTModule
from .tt_embedding import TTEmbedding
from .tt_linear import TTLinear
from .tied_head import TiedTTHead

__all__ = ["TTEmbedding", "TTLinear", "TTModule", "TiedTTHead"]
