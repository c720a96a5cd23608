"""ComeraQuantizer: transformers' loading hook for compressed checkpoints.

Registered as quantization method "comera" on ``import comera_convert``. Before transformers
loads the weights, it swaps the skeleton's dense modules for TT modules of the recorded shapes
(after checking the checkpoint's tensors agree with the records), so ``model.safetensors`` loads
straight into the cores; an integer checkpoint's factors load into integer buffers and become
float parameters after (``integer_storage.py``). The model stays trainable: ``Trainer`` accepts it.
"""

from __future__ import annotations

from transformers.quantizers import HfQuantizer

from ..conversion.records import build_from_records, tie_heads_to_converted_embeddings
from .checkpoint_check import check_codes, check_row_orders, check_tensors_match
from .compat import mark_compressed, register_quantization_method, untie_converted_heads
from .config import QUANT_METHOD, WEIGHTS_GUARD, ComeraConfig
from .integer_storage import IntegerLoading
from .saving import save_compressed


class ComeraQuantizer(HfQuantizer):
    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._dtype = None
        self._integers = None  # an integer checkpoint's parameters, read as integers, restored after

    @staticmethod
    def _past_the_guard(config):
        """Point transformers past the guard file name, to model.safetensors."""
        if getattr(config, "transformers_weights", None) == WEIGHTS_GUARD:
            config.transformers_weights = None
        return config

    # The config hooks transformers calls before it resolves the weight files (compat.py, touch 6):
    # update_attn_implementation from 5.2x, update_tp_plan / update_ep_plan before that. Each one
    # clears the guard; whichever runs.
    def update_attn_implementation(self, config):
        return self._past_the_guard(config)

    def update_tp_plan(self, config):
        return self._past_the_guard(config)

    def update_ep_plan(self, config):
        return self._past_the_guard(config)

    def preprocess_model(self, model, dtype=None, **kwargs):
        self._dtype = dtype
        return super().preprocess_model(model, dtype=dtype, **kwargs)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        records = self.quantization_config.modules
        first = next(model.parameters())
        build_from_records(model, records, dtype=self._dtype or first.dtype, device=first.device)
        tie_heads_to_converted_embeddings(model)
        untie_converted_heads(model)
        fmt = self.quantization_config.integer_format()
        if checkpoint_files and fmt is not None:
            self._integers = IntegerLoading(fmt)
            self._integers.prepare(model, checkpoint_files)
        if checkpoint_files:
            check_tensors_match(model, checkpoint_files)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self._integers is not None:
            self._integers.restore()
            self._integers = None
        check_row_orders(model)
        check_codes(model)
        mark_converted(model, self.quantization_config)
        return model

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        # TT cores are ordinary float parameters: the whole model trains, no adapters needed.
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def mark_converted(model, quantization_config: ComeraConfig) -> None:
    """Make a converted (or just loaded) model look and save like a loaded compressed model: the
    config records the compression, and ``save_pretrained`` writes compressed checkpoints."""
    mark_compressed(model, quantization_config, ComeraQuantizer(quantization_config, pre_quantized=True),
                    save_compressed)


def register() -> None:
    """Register the "comera" method with transformers (idempotent)."""
    register_quantization_method(QUANT_METHOD, ComeraConfig, ComeraQuantizer)
