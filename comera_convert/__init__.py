"""comera_convert: tensor-train compression and rank-adaptive training of Hugging Face models.

    import comera_convert
    report = comera_convert.convert(model, ratio=4, tokenizer=tokenizer)  # in place, calibrated
    model.save_pretrained("model-tt4")                       # a compressed checkpoint
    AutoModel.from_pretrained("model-tt4")                   # loads it (after the import)

Importing the package registers the "comera" loading method with transformers (as transformers'
quantizers load, which ``from_pretrained`` does first: ``hf/registration.py``); that is its one
side effect. Everything else loads when first used, so the CLI's --help stays quick.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from .hf.registration import register_with_transformers as _register_with_transformers  # noqa: E402

_register_with_transformers()

# Public name -> the module that defines it (imported on first use).
EXPORTS = {
    "convert": "api", "convert_checkpoint": "api", "calibrate": "api", "decompress": "api",
    "decompress_model": "api", "from_pretrained": "api", "ConversionResult": "api",
    "train": "training", "TrainOptions": "training", "evaluate": "evaluation",
    "ConvertOptions": "conversion", "ConvertRequest": "conversion", "ConvertPlan": "conversion", "plan": "conversion",
    "ConversionReport": "conversion", "Calibration": "conversion",
    "ComeraError": "errors",
    "TTLinear": "layers", "TTEmbedding": "layers", "CodebookEmbedding": "layers", "TTModule": "layers",
    "TiedTTHead": "layers",
    "use_int8_compute": "layers", "Int8Linear": "layers",
    "lora_config": "hf.lora", "load_lora": "hf.lora",  # need peft
}
__all__ = ["__version__", *EXPORTS]


def __getattr__(name: str):
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'comera_convert' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))
