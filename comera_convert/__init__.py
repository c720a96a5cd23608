"""comera_convert: tensor-train compression and rank-adaptive training of Hugging Face models.

    import comera_convert
    report = comera_convert.convert(model, ratio=4)          # in place
    model.save_pretrained("model-tt4")                       # a compressed checkpoint
    AutoModel.from_pretrained("model-tt4")                   # loads it (after the import)
"""

__version__ = "0.1.0"

from .conversion import ConversionReport, ConvertOptions, convert  # noqa: E402
from .errors import ComeraError  # noqa: E402
from .hf.quantizer import register as _register_with_transformers  # noqa: E402
from .layers import TiedTTHead, TTEmbedding, TTLinear, TTModule  # noqa: E402

_register_with_transformers()

__all__ = ["ComeraError", "ConversionReport", "ConvertOptions", "TTEmbedding", "TTLinear", "TTModule",
           "TiedTTHead", "__version__", "convert"]

from .hf.loading import decompress, from_pretrained  # noqa: E402

__all__ += ["decompress", "from_pretrained"]


def __getattr__(name: str):
    """The peft helpers import peft, so only when asked for."""
    if name in ("lora_config", "load_lora"):
        from .hf import lora

        return getattr(lora, name)
    raise AttributeError(f"module 'comera_convert' has no attribute {name!r}")
