"""ComeraConfig: the compression layout, stored as the model config's ``quantization_config``.

transformers writes it into config.json with the rest of the config and reads it back on
``from_pretrained``; a registered quantizer (``quantizer.py``) turns it into TT modules.
"""

from __future__ import annotations

import copy
import weakref

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..conversion.records import format_version, records_of
from ..conversion.storage import INTEGER_BITS, integer_format
from ..errors import ModelLoadError, expected

QUANT_METHOD = "comera"
# Bump when the record format changes; older versions must keep loading. 2: embeddings may hold
# their rows in another order than the token ids ("reordered", with a row_of_token tensor). 3: an
# embedding may be a product-quantized table ("codebook_embedding", with codebooks and codes tensors).
# 4: factors may be stored as integers ("storage": {"format": "int8" | "int4", "group_size": ...},
# each such tensor as values and a ``<name>_scale`` tensor; hf/integer_storage.py). 5: a feed-forward
# pair may be pruned by hidden neuron ("pruned_linear", plain linear tensors of the pruned shape).
FORMAT_VERSION = 5
INTEGER_STORAGE_VERSION = 4
# config.json names this file as the model's weights. It does not exist: a transformers that does
# not know comera_convert stops on it with this instruction, instead of loading a dense model
# with random weights. comera_convert's quantizer points transformers at model.safetensors.
WEIGHTS_GUARD = "comera-tt-checkpoint--pip-install-comera-convert--then-import-comera_convert.safetensors"
# What a compressed checkpoint's config.json holds beyond the architecture's own config.
COMPRESSION_KEYS = ("quantization_config", "transformers_weights", "auto_map")


def compression_of(config: dict) -> dict | None:
    """The compression record of a config.json dict, or None for a model that is not compressed."""
    quantization = config.get("quantization_config") or {}
    return quantization if quantization.get("quant_method") == QUANT_METHOD else None


class ComeraConfig(QuantizationConfigMixin):
    def __init__(self, modules: dict | None = None, version: int = FORMAT_VERSION, source: str | None = None,
                 dense_params: int | None = None, quant_method: str = QUANT_METHOD, storage: dict | None = None,
                 **kwargs):
        if quant_method != QUANT_METHOD:
            raise ModelLoadError(expected(f"quant_method {QUANT_METHOD!r}", quant_method))
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ModelLoadError(f"this checkpoint uses comera format version {version}, newer than this "
                                 f"comera_convert understands ({FORMAT_VERSION}): upgrade comera-convert")
        self.quant_method = QUANT_METHOD
        self.version = version
        self.source = source
        self.dense_params = dense_params  # the source model's parameter count, for ratios
        self.modules = dict(modules or {})
        # How the factors are written: None (in the model's float dtype) or an integer format,
        # {"format": "int8" | "int4", "group_size": None | int} (``integer_format``).
        self.storage = dict(storage) if storage else None
        if self.storage is not None:
            self.integer_format()  # refuse a record this release cannot read, in one line
        self._model = None

    def round_as_trained(self) -> None:
        """Record that the factors are to be rounded as quantization-aware training rounds them
        (each group's largest magnitude its scale), the grid the model learned on."""
        if self.storage is not None:
            self.storage["clip_search"] = False

    def integer_format(self):
        """The IntegerFormat the factors are stored in, or None for float storage."""
        if self.storage is None:
            return None
        name = self.storage.get("format")
        if name not in INTEGER_BITS:
            raise ModelLoadError(f"this checkpoint stores its factors as {name!r}, which this comera_convert "
                                 f"cannot read (it reads {' and '.join(INTEGER_BITS)}): upgrade comera-convert")
        try:
            clip_search = self.storage.get("clip_search", True) is not False
            return integer_format(name, self.storage.get("group_size"), clip_search)
        except ValueError as err:
            raise ModelLoadError(f"the checkpoint's integer storage record is not valid: {err}") from None

    def attach(self, model) -> None:
        """Follow a live model, so the saved records carry its current (possibly pruned) ranks."""
        self._model = weakref.ref(model)

    def to_dict(self) -> dict:
        model = self._model() if self._model is not None else None
        modules = records_of(model) if model is not None else self.modules
        # The version the records need, so that checkpoints older readers can load keep loading there.
        version = max(INTEGER_STORAGE_VERSION if self.storage else 1, format_version(modules))
        data = {"quant_method": self.quant_method, "version": version, "source": self.source,
                "dense_params": self.dense_params, "modules": copy.deepcopy(modules)}
        if self.storage:
            data["storage"] = dict(self.storage)
        return data

    def __iter__(self):
        yield from self.to_dict().items()

    def __deepcopy__(self, memo):
        clone = ComeraConfig(**{k: v for k, v in self.to_dict().items()})
        clone._model = self._model
        return clone


def integer_format_of(model):
    """The IntegerFormat a compressed model's checkpoints store its factors in, or None (floats)."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    return config.integer_format() if isinstance(config, ComeraConfig) else None
