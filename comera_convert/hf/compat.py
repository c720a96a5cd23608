"""Every place comera_convert reaches past transformers' public API, in one module.

transformers has no public hook for what a compressed model needs from it, so these lean on
internals. Each function names what it touches; ``tests/test_compat.py`` has a test per touch
point, so a transformers release that moves one fails there, by name, rather than somewhere in a
conversion. The supported range is declared in pyproject.toml (``SUPPORTED_TRANSFORMERS``);
``tools/test_dependency_ends.sh`` (run by CI) runs the integration tests on its lowest and newest
releases, with the lowest and newest torch.

Touch points:
  1. ``PreTrainedModel.all_tied_weights_keys``: the tying entries of converted modules are dropped
     (and, streaming, the dense ones re-tied after loading).
  2. ``PreTrainedModel._adjust_bias``: patched on the instance so tying leaves a TiedTTHead alone.
  3. ``model.hf_quantizer`` / ``is_quantized`` / ``quantization_method``: set on converted models
     (as transformers sets them on loaded quantized ones) and removed on decompression.
  4. ``get_expanded_tied_weights_keys``: restores transformers' tying after decompression.
  5. ``save_pretrained``: replaced on the converted instance (never on the class).
  6. ``HfQuantizer`` config hooks (``update_attn_implementation`` from 5.2x, ``update_tp_plan`` /
     ``update_ep_plan`` before): where the checkpoint's weights guard is cleared.
  7. The quantizer registries (``register_quantizer`` / ``register_quantization_config``).
  8. ``Trainer._save_checkpoint`` / ``_save`` / ``_load_from_checkpoint`` /
     ``_load_optimizer_and_scheduler`` (``TRAINER_HOOKS``) and ``_save_rng_state``: overridden here,
     in ``TrainerCheckpointHooks``, which hands each to a public-named method of ComeraTrainer
     (truncated checkpoints, sharded optimizer state), so the trainer never names a private method.
  9. ``remove_tied_weights_from_state_dict`` / ``revert_weight_conversion``: the tensor names
     ``save_pretrained`` writes, for a streamed conversion that writes its checkpoint itself.
 10. ``PreTrainedModel._is_distributed_loading_by_transformers`` and ``config.distributed_config``:
     set on a model `comera train --fsdp` sharded, so that the Trainer treats it as one sharded at
     load time (no DDP wrap, no move; replicated gates broadcast and their gradients averaged);
     and ``output_capturing._CAN_RECORD_REGISTRY``, keyed by class name, given the FSDP class's
     entry (without it a sharded model returns no hidden states, and distillation fails).
"""

from __future__ import annotations

import types

from torch import nn

from ..errors import ConfigError
from ..layers import CodebookEmbedding, TiedTTHead, TTModule

SUPPORTED_TRANSFORMERS = ">=5.1,<6"
TRAINER_HOOKS = ("_save_checkpoint", "_save", "_load_from_checkpoint", "_load_optimizer_and_scheduler")
CONFIG_HOOKS = ("update_attn_implementation", "update_tp_plan", "update_ep_plan")


# 1, 2 --------------------------------------------------------------------------------------------
def untie_converted_heads(model: nn.Module) -> None:
    """Drop transformers' weight-tying entries that point at converted modules (touch 1), and keep
    its bias adjustment away from TiedTTHeads (touch 2).

    The TiedTTHead shares the embedding's cores by itself; transformers' own tying would look for a
    dense ``weight`` parameter that no longer exists.
    """
    tied = getattr(model, "all_tied_weights_keys", None)
    if not tied:
        return
    converted = [name for name, module in model.named_modules()
                 if isinstance(module, (TTModule, CodebookEmbedding, TiedTTHead))]

    def touches(param_name: str) -> bool:
        return any(param_name == f"{m}.weight" for m in converted)

    model.all_tied_weights_keys = {t: s for t, s in tied.items() if not (touches(t) or touches(s))}
    if hasattr(type(model), "_adjust_bias"):
        model._adjust_bias = types.MethodType(_adjust_bias_except_tied_heads, model)


def _adjust_bias_except_tied_heads(model, output_embeddings, input_embeddings) -> None:
    """transformers' tying pads a tied head's bias to its ``weight.shape``: for a TiedTTHead that
    would build the whole embedding table (twice, 94 MB each for bert-base's vocabulary) while
    loading, and its bias already spans the vocabulary, so the head is left alone."""
    if not isinstance(output_embeddings, TiedTTHead):
        type(model)._adjust_bias(model, output_embeddings, input_embeddings)


def retie_dense_heads(model: nn.Module) -> set[str]:
    """Share each tied parameter that stayed dense with its source again (touch 1): after a streaming
    conversion gave the source its stored value, the head still held the meta placeholder. Returns
    the tied parameters whose source is converted already (mid-conversion): the conversion ties
    their heads to the TT module at its end."""
    waiting = set()
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        module_name, _, param_name = target.rpartition(".")
        try:
            shared = model.get_parameter(source)
        except AttributeError:
            waiting.add(target)
            continue
        setattr(model.get_submodule(module_name), param_name, shared)
    return waiting


# 3, 5 --------------------------------------------------------------------------------------------
def mark_compressed(model: nn.Module, quantization_config, hf_quantizer, save) -> None:
    """Make a converted model look and save like a loaded compressed model: its config records the
    compression (following the live modules; touch 3), ``hf_quantizer`` stands as the one that
    loaded it, and ``save_pretrained`` calls ``save`` (touch 5). quantizer.mark_converted passes
    the "comera" quantizer and the compressed checkpoint writer."""
    quantization_config.attach(model)
    install_save_hook(model, save)
    config = getattr(model, "config", None)
    if config is None:
        return  # a plain nn.Module: nothing more to record
    config.quantization_config = quantization_config
    model.hf_quantizer = hf_quantizer
    model.is_quantized = True
    model.quantization_method = quantization_config.quant_method


def install_save_hook(model: nn.Module, save) -> None:
    """Route this model's ``save_pretrained`` through ``save(model, directory, overwrite=True, ...)``
    (the instance only; touch 5)."""

    def save_pretrained(self, save_directory, **kwargs):
        return save(self, save_directory, overwrite=True, **kwargs)

    model.save_pretrained = types.MethodType(save_pretrained, model)


# 3, 4, 5 -----------------------------------------------------------------------------------------
def forget_compression(model: nn.Module) -> None:
    """Undo ``mark_compressed`` on a decompressed model, and restore transformers' own tying (touch 4)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        del config.quantization_config
    for attr in ("hf_quantizer", "quantization_method", "save_pretrained", "_adjust_bias"):
        if attr in model.__dict__:
            delattr(model, attr)
    model.is_quantized = False
    if hasattr(model, "get_expanded_tied_weights_keys"):
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=False)


# 7 -----------------------------------------------------------------------------------------------
def register_quantization_method(name: str, config_class, quantizer_class) -> None:
    """Register a quantization method with transformers' Auto mappings (idempotent; touch 7)."""
    from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                              register_quantization_config, register_quantizer)

    if name not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(name)(config_class)
    if name not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(name)(quantizer_class)


# 8 -----------------------------------------------------------------------------------------------
class TrainerCheckpointHooks:
    """Mixed in before transformers' ``Trainer``: its private checkpoint methods, handed to the methods a
    subclass defines, each given the Trainer's own behaviour as a callable where it may defer to it.

        write_checkpoint(model, trial, save)      a checkpoint folder (``save()``: the Trainer's own)
        write_model(output_dir)                   the model files of a checkpoint or the final model
        read_checkpoint(folder, model)            the model state back from a checkpoint folder
        read_training_state(checkpoint, load)     optimizer and schedule (``load()``: the Trainer's own)
    """

    def _save_checkpoint(self, model, trial) -> None:
        self.write_checkpoint(model, trial, lambda: super(TrainerCheckpointHooks, self)._save_checkpoint(model, trial))

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        self.write_model(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self.read_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        load = super(TrainerCheckpointHooks, self)._load_optimizer_and_scheduler
        self.read_training_state(checkpoint, lambda: load(checkpoint))

    def save_rng_state(self, folder: str) -> None:
        """Every worker's random state into ``folder``, as the Trainer's checkpoints keep it."""
        self._save_rng_state(folder)


# 9 -----------------------------------------------------------------------------------------------
def saved_tensor_names(model: nn.Module) -> list[str]:
    """The names ``save_pretrained`` gives ``model``'s tensors, in its order: the state dict less
    tied copies, renamed back to the checkpoint format (touch 9). Works on meta tensors."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    full = model.state_dict()
    # Buffers are never tied weights, and releases before 5.14 look a meta entry up as a parameter
    # (``get_parameter``), which fails on a meta buffer such as a reordered embedding's
    # ``row_of_token``: such entries go around the tie search and come back in their place.
    set_aside = {name for name, _ in model.named_buffers() if name in full and full[name].is_meta}
    kept = remove_tied_weights_from_state_dict({n: t for n, t in full.items() if n not in set_aside}, model)
    state = {name: tensor for name, tensor in full.items() if name in kept or name in set_aside}
    renamed = revert_weight_conversion(model, state)
    if renamed.keys() != state.keys():
        raise NotImplementedError(f"{type(model).__name__} saves its tensors under other names than it holds them: "
                                  f"it cannot be written from a spool")
    return list(renamed)


# 10 ----------------------------------------------------------------------------------------------
def mark_sharded(model: nn.Module, workers: int, original_class: type) -> None:
    """Tell transformers' Trainer that ``model`` is already sharded with FSDP2 across ``workers``
    (touch 10): it then prepares it without a DDP wrap or a move, keeps the parameters FSDP does not
    manage (the rank gates) equal on every worker, and defers gradient reduction over accumulation.
    ``fully_shard`` gave the model a class of its own (FSDP<original_class>): the outputs the
    original class records (hidden states, attentions) are registered for it too. This transformers
    has the Trainer's support for such models (``check_sharded_training``, run before loading)."""
    from transformers.distributed import DistributedConfig
    from transformers.utils import output_capturing

    model._is_distributed_loading_by_transformers = True
    model.config.distributed_config = DistributedConfig(fsdp_size=workers, dp_replicate_size=1)
    registry = output_capturing._CAN_RECORD_REGISTRY
    recorded = dict.get(registry, str(original_class))
    if recorded:
        registry[model] = recorded


def check_sharded_training() -> None:
    """Refuse --fsdp, in one line, on a transformers whose Trainer cannot train a model sharded
    before it (touch 10)."""
    from transformers import PreTrainedModel, Trainer, __version__

    if not (isinstance(getattr(PreTrainedModel, "is_distributed_loading_by_transformers", None), property)
            and hasattr(Trainer, "_sync_replicated_trainable_parameters")):
        raise ConfigError(f"--fsdp needs a transformers whose Trainer trains models sharded before it "
                          f"(5.19 and later have it); this one is {__version__}")


def check_resume_support() -> None:
    """Refuse --resume, in one line, where transformers will not read a checkpoint's optimizer state:
    it loads it with torch.load, which it refuses on torch before 2.6 (CVE-2025-32434)."""
    import torch
    from transformers.utils.import_utils import check_torch_load_is_safe

    try:
        check_torch_load_is_safe()
    except ValueError:
        raise ConfigError(f"--resume needs torch 2.6 or later: transformers reads a checkpoint's optimizer state "
                          f"with torch.load, which it refuses on older torch (CVE-2025-32434); this one is "
                          f"{torch.__version__}") from None
