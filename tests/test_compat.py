"""One test per place comera_convert reaches into transformers' internals (hf/compat.py, numbered
there): a transformers release that moves one fails here, by name."""

import inspect

import pytest
import torch
import transformers as tf
from transformers.quantizers import HfQuantizer

import comera_convert
from comera_convert.errors import ConfigError
from comera_convert.hf import compat
from comera_convert.hf.quantizer import ComeraQuantizer
from comera_convert.layers import TiedTTHead
from comera_convert.training.trainer import ComeraTrainer

from .tiny_models import build, outputs


def saved(case, tmp_path):
    model = build(case)
    comera_convert.convert(model, ratio=3)
    model.save_pretrained(tmp_path / case)
    return model, tmp_path / case


def test_1_tied_weight_keys_of_converted_heads_are_dropped():
    model = build("gpt2-clm")
    assert "lm_head.weight" in model.all_tied_weights_keys  # what transformers ties on its own
    comera_convert.convert(model, ratio=3)
    assert isinstance(model.lm_head, TiedTTHead)
    assert "lm_head.weight" not in model.all_tied_weights_keys


def test_1_dense_tied_heads_are_tied_again_after_streaming_loads_their_embedding(tmp_path):
    from comera_convert.pipeline import streaming

    build("gpt2-clm").save_pretrained(tmp_path / "dense")
    loader = streaming.Streamed(str(tmp_path / "dense"))
    model = loader.skeleton()
    assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.weight.is_meta
    streaming.load_the_rest(model, loader.source)  # nothing converted: every tensor read, the head tied again
    assert model.lm_head.weight is model.transformer.wte.weight and not model.lm_head.weight.is_meta
    assert torch.equal(outputs(model.eval()), outputs(build("gpt2-clm")))


def test_2_bias_adjustment_leaves_tied_heads_alone(tmp_path, monkeypatch):
    assert hasattr(tf.PreTrainedModel, "_adjust_bias")
    _, path = saved("bert-mlm", tmp_path)
    loaded = tf.AutoModelForMaskedLM.from_pretrained(path)
    head = loaded.cls.predictions.decoder
    assert isinstance(head, TiedTTHead) and "_adjust_bias" in loaded.__dict__
    monkeypatch.setattr(TiedTTHead, "dense_weight", lambda self: (_ for _ in ()).throw(AssertionError("built")))
    loaded._adjust_bias(head, loaded.get_input_embeddings())  # would build the table through .weight


def test_3_converted_models_are_marked_as_transformers_marks_quantized_ones(tmp_path):
    model = build("bert-mlm")
    comera_convert.convert(model, ratio=3)
    assert model.is_quantized and isinstance(model.hf_quantizer, ComeraQuantizer)
    assert model.quantization_method == "comera" and model.hf_quantizer.is_trainable
    # transformers' Trainer reads the marks and refuses quantized models that cannot train: not ours.
    args = tf.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    tf.Trainer(model=model, args=args)
    model.hf_quantizer = type("Frozen", (ComeraQuantizer,), {"is_trainable": property(lambda self: False)})(
        model.hf_quantizer.quantization_config, pre_quantized=True)
    try:
        tf.Trainer(model=model, args=args)
    except ValueError as err:
        assert "quantized" in str(err).lower()
    else:
        raise AssertionError("transformers no longer checks hf_quantizer.is_trainable")


def test_4_decompression_restores_transformers_tying():
    assert hasattr(tf.PreTrainedModel, "get_expanded_tied_weights_keys")
    model = build("gpt2-clm")
    comera_convert.convert(model, ratio=3)
    comera_convert.decompress_model(model)
    assert "lm_head.weight" in model.all_tied_weights_keys and not model.is_quantized
    assert model.lm_head.weight is model.transformer.wte.weight


def test_5_save_pretrained_is_replaced_on_the_instance_only(tmp_path):
    model = build("bert")
    comera_convert.convert(model, ratio=3)
    assert "save_pretrained" in model.__dict__
    assert tf.BertModel.save_pretrained is tf.PreTrainedModel.save_pretrained  # the class is untouched
    model.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "comera_report.json").is_file()


def test_6_a_config_hook_that_clears_the_guard_is_called_on_load(tmp_path, monkeypatch):
    assert any(hasattr(HfQuantizer, hook) for hook in compat.CONFIG_HOOKS)
    model, path = saved("bert", tmp_path)
    calls = []
    real = ComeraQuantizer._past_the_guard
    monkeypatch.setattr(ComeraQuantizer, "_past_the_guard", staticmethod(lambda c: calls.append(1) or real(c)))
    loaded = tf.AutoModel.from_pretrained(path)
    assert calls and torch.equal(outputs(loaded.eval()), outputs(model.eval()))


def test_7_the_quantization_method_is_registered():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZER_MAPPING["comera"] is ComeraQuantizer
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["comera"].__name__ == "ComeraConfig"


def test_8_trainer_hooks_keep_the_signatures_comera_overrides():
    for name in compat.TRAINER_HOOKS:
        theirs = list(inspect.signature(getattr(tf.Trainer, name)).parameters)
        ours = list(inspect.signature(getattr(ComeraTrainer, name)).parameters)
        assert theirs == ours, f"Trainer.{name}{theirs} vs ComeraTrainer.{name}{ours}"
        assert getattr(ComeraTrainer, name) is not getattr(tf.Trainer, name)


def test_8_only_compat_names_the_trainers_private_methods():
    from pathlib import Path

    training = Path(comera_convert.__file__).parent / "training"
    for path in training.rglob("*.py"):
        text = path.read_text()
        for name in (*compat.TRAINER_HOOKS, "_save_rng_state"):
            assert f"def {name}(" not in text and f".{name}(" not in text, f"{path.name} names Trainer.{name}"


def test_9_the_names_save_pretrained_writes_are_known_before_writing(tmp_path):
    from safetensors import safe_open

    from comera_convert.hf.compat import saved_tensor_names

    model = build("bert-mlm")  # a tied decoder weight and bias: the copies are not written
    comera_convert.convert(model, ratio=2)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as stored:
        assert sorted(saved_tensor_names(model)) == sorted(stored.keys())
    assert len(saved_tensor_names(model)) < len(model.state_dict())


def test_9_names_are_known_on_the_meta_device_with_a_reordered_embedding(tmp_path):
    """A streamed conversion asks for the names of a meta model whose embedding keeps its rows in
    another order (a ``row_of_token`` buffer): releases before 5.14 looked meta buffers up as
    parameters and failed."""
    from safetensors import safe_open

    from comera_convert.hf.compat import saved_tensor_names
    from comera_convert.pipeline.spool import to_meta
    from comera_convert.layers import TTEmbedding

    model = build("bert-mlm")
    comera_convert.convert(model, ratio=2, targets=["bert.encoder.*"])
    words = model.bert.embeddings.word_embeddings
    model.bert.embeddings.word_embeddings = TTEmbedding.from_embedding(
        words, rank=4, token_order=torch.randperm(words.num_embeddings, generator=torch.Generator().manual_seed(0)))
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as stored:
        written = sorted(stored.keys())
    assert "bert.embeddings.word_embeddings.row_of_token" in written
    to_meta(model)
    assert sorted(saved_tensor_names(model)) == written


def _trains_sharded_models() -> bool:
    try:
        compat.check_sharded_training()
    except ConfigError:
        return False
    return True


# Touch 10 exists from transformers 5.19 (and torch 2.6); before them --fsdp is refused in one line.
needs_sharded_trainer = pytest.mark.skipif(
    not _trains_sharded_models(),
    reason=f"transformers {tf.__version__} / torch {torch.__version__} cannot train models sharded before the Trainer")


@needs_sharded_trainer
def test_10_a_model_marked_sharded_is_neither_wrapped_nor_moved_by_the_trainer(tmp_path):
    model = build("llama-clm")
    compat.mark_sharded(model, workers=2, original_class=type(model))
    assert model.is_distributed_loading_by_transformers
    assert model.config.distributed_config.fsdp_size == 2 and model.config.distributed_config.dp_replicate_size == 1
    args = tf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_only_model=True)
    trainer = tf.Trainer(model=model, args=args)
    assert trainer.is_distributed_loading_by_transformers and not trainer.place_model_on_device
    # Why --fsdp saves AdamW's state itself: the Trainer keeps none for such a model.
    with pytest.raises(ValueError, match="save_only_model"):
        tf.Trainer(model=model, args=tf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))


@needs_sharded_trainer
def test_10_a_sharded_model_still_records_its_hidden_states(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from .tiny_models import inputs

    model = build("bert")  # a base model records its hidden states itself (a sentence encoder, distilled)
    expected = model(**inputs(), output_hidden_states=True).hidden_states
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        original = type(model)
        fully_shard(model)  # the model's class is now FSDPBertModel
        assert model(**inputs(), output_hidden_states=True).hidden_states is None  # transformers alone
        compat.mark_sharded(model, workers=1, original_class=original)
        hidden = model(**inputs(), output_hidden_states=True).hidden_states
    finally:
        dist.destroy_process_group()
    assert len(hidden) == len(expected)
    assert all(torch.allclose(a, b) for a, b in zip(hidden, expected))


def test_10_a_transformers_without_it_is_refused_in_one_line(monkeypatch):
    monkeypatch.delattr(tf.Trainer, "_sync_replicated_trainable_parameters", raising=False)
    with pytest.raises(ConfigError, match=f"5.19 and later have it\\); this one is {tf.__version__}"):
        compat.check_sharded_training()


def test_the_declared_range_is_the_packages_and_admits_this_transformers():
    from pathlib import Path

    import pytest
    from packaging.specifiers import SpecifierSet

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = next(d for d in pyproject["project"]["dependencies"] if d.startswith("transformers"))
    assert declared.removeprefix("transformers") == compat.SUPPORTED_TRANSFORMERS
    assert tf.__version__ in SpecifierSet(compat.SUPPORTED_TRANSFORMERS)
