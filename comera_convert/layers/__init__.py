"""nn.Modules over the TT and codebook math: thin wrappers that hold cores and rank gates, or codebooks and codes."""

from .base import TTModule
from .codebook_embedding import CodebookEmbedding
from .tt_embedding import TTEmbedding
from .tt_linear import TTLinear
from .tied_head import TiedTTHead

__all__ = ["CodebookEmbedding", "TTEmbedding", "TTLinear", "TTModule", "TiedTTHead"]
