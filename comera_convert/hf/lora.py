"""peft LoRA adapters on compressed models, TT layers included.

peft adapts the layer types it knows (nn.Linear, Conv1D, ...) and refuses the rest. On a
compressed model its plain LoRA layer would run on a TTLinear (it only needs the layer's output),
but merging would write the update into a ``weight`` the TT layer does not have: the merged model
would silently be the unadapted one. ``lora_config`` registers ``TTLoraLinear`` for TTLinear, which
adds the adapter's output to the TT layer's and refuses to merge. The remaining dense layers
(classifier heads, layers left dense) take peft's own LoRA as always.

    from comera_convert import load_lora, lora_config
    model = get_peft_model(model, lora_config(r=8, target_modules=["query", "value"], task_type="SEQ_CLS"))
    model.save_pretrained("adapter")                      # peft's adapter folder, as always
    model = load_lora(compressed_model, "adapter")        # PeftModel.from_pretrained, TT layers known
"""

from __future__ import annotations

from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Linear as LoraLinear

from ..errors import ConfigError
from ..layers import TTLinear

MERGE_REFUSED = ("a LoRA adapter cannot be merged into a tensor-train layer (the sum is not a tensor train "
                 "of the same ranks): keep the adapter separate (PeftModel), or load it onto "
                 "comera_convert.decompress_model(model) and merge into the dense layers")


class TTLoraLinear(LoraLinear):
    """peft's LoRA around a TTLinear: y = TT(x) + scale * B(A(x)), never merged into the cores."""

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise ConfigError(MERGE_REFUSED)

    def unmerge(self) -> None:
        return  # nothing is ever merged


def register_tt_layers(config: LoraConfig) -> LoraConfig:
    """Let ``config`` target TTLinear layers (in place; returns it)."""
    config._register_custom_module({TTLinear: TTLoraLinear})
    return config


def lora_config(**kwargs) -> LoraConfig:
    """A peft ``LoraConfig`` (same arguments) whose target modules may be TT layers."""
    return register_tt_layers(LoraConfig(**kwargs))


def load_lora(model, adapter, **kwargs) -> PeftModel:
    """``PeftModel.from_pretrained(model, adapter)`` for an adapter trained on TT layers (the saved
    adapter_config.json cannot say which custom layers it needs)."""
    return PeftModel.from_pretrained(model, adapter, config=register_tt_layers(LoraConfig.from_pretrained(adapter)),
                                     **kwargs)
