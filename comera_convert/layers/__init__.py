"""nn.Modules over the TT and codebook math: thin wrappers that hold cores and rank gates, or codebooks and codes."""

from .base import TTModule
from .codebook_embedding import CodebookEmbedding
from .int8_compute import Int8Linear, Int8Swap, use_int8_compute
from .pruned_linear import PrunedLinear
from .tt_embedding import TTEmbedding
from .tt_linear import TTLinear
from .tied_head import TiedTTHead

__all__ = ["CodebookEmbedding", "Int8Linear", "Int8Swap", "PrunedLinear", "TTEmbedding", "TTLinear", "TTModule",
           "TiedTTHead",
           "use_int8_compute"]
