"""Pure codebook math over torch tensors: no nn.Module, no transformers.

kmeans    Lloyd's k-means, many independent problems at once (one per slice of the columns)
product   product quantization of a table: per slice of its columns, a codebook and one code per row
spec      CodebookSpec: slices and centres of a quantized table, and what it stores
"""

from .kmeans import kmeans
from .product import dense_from_codes, product_quantize
from .spec import CodebookSpec

__all__ = ["CodebookSpec", "dense_from_codes", "kmeans", "product_quantize"]
