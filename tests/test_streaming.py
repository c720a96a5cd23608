"""Streaming conversion: a plain conversion of a local safetensors checkpoint builds the model on the
meta device and reads each layer's weights just before decomposing it, and ends with the same
checkpoint as converting the loaded model."""

import json

import pytest
import torch
import transformers as tf

import comera_convert
from comera_convert.api import convert_checkpoint
from comera_convert.conversion import ConvertOptions
from comera_convert.errors import ModelLoadError
from comera_convert.hf import streaming
from comera_convert.layers import TTModule

from .tiny_models import build, outputs

AUTO = {"clm": tf.AutoModelForCausalLM, "mlm": tf.AutoModelForMaskedLM}


@pytest.mark.parametrize("case, head", [("llama-clm", "clm"), ("gpt2-clm", "clm"), ("bert-mlm", "mlm"),
                                        ("distilbert-mlm", "mlm"), ("mistral-clm", "clm")])
@pytest.mark.parametrize("shard", [None, "100KB"])
def test_a_streamed_conversion_equals_the_in_memory_one(case, head, shard, tmp_path):
    dense = build(case)
    dense.save_pretrained(tmp_path / "dense", **({"max_shard_size": shard} if shard else {}))
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert result.report.extra["streamed"]
    reference = build(case)
    expected = comera_convert.convert(reference, ratio=2)
    assert result.report.modules == expected.modules and result.report.params_after == expected.params_after
    loaded = AUTO[head].from_pretrained(tmp_path / "tt").eval()
    assert torch.allclose(outputs(loaded), outputs(reference.eval()), atol=1e-5)


def test_each_dense_layer_is_in_memory_only_while_it_is_decomposed(tmp_path, monkeypatch):
    build("llama-clm").save_pretrained(tmp_path / "dense")
    seen = []
    real = streaming.load_module

    def watched(model, name, source):
        # When a layer is read, every layer read before it is already TT: never two dense at once.
        dense_linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                         and not m.weight.is_meta and n != "lm_head"]
        assert dense_linears == [], dense_linears
        seen.append(name)
        real(model, name, source)

    monkeypatch.setattr(streaming, "load_module", watched)
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert len(seen) == len(result.report.modules) - sum(m.kind == "tied_head" for m in result.report.modules)
    model = comera_convert.from_pretrained(tmp_path / "tt")
    assert sum(isinstance(m, TTModule) for m in model.modules()) == len(seen)


def test_calibrated_conversion_loads_the_whole_model(tmp_path):
    from .test_eval import saved

    path = saved(tmp_path, "bert-mlm", ratio=2)  # a dense model with a tokenizer next to it
    result = convert_checkpoint(str(tmp_path / "bert-mlm-dense"), tmp_path / "tt", ConvertOptions(ratio=2),
                                default_calibration=None)
    assert result.report.extra["streamed"]
    tf.AutoTokenizer.from_pretrained(path).save_pretrained(tmp_path / "bert-mlm-dense")
    calibrated = convert_checkpoint(str(tmp_path / "bert-mlm-dense"), tmp_path / "tt-cal",
                                    ConvertOptions(ratio=2, calibration="english", calibration_sequences=32))
    assert "streamed" not in calibrated.report.extra and "calibration" in calibrated.report.extra


def test_a_missing_or_truncated_shard_is_refused_in_one_line(tmp_path):
    build("llama-clm").save_pretrained(tmp_path / "dense", max_shard_size="100KB")
    shards = sorted((tmp_path / "dense").glob("model-*.safetensors"))
    shards[0].write_bytes(shards[0].read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="truncated"):
        convert_checkpoint(str(tmp_path / "dense"), tmp_path / "a", ConvertOptions(ratio=2))
    shards[0].unlink()
    with pytest.raises(ModelLoadError, match=f"names {shards[0].name}, which .* does not have"):
        convert_checkpoint(str(tmp_path / "dense"), tmp_path / "b", ConvertOptions(ratio=2))
    index = json.loads((tmp_path / "dense" / "model.safetensors.index.json").read_text())
    assert shards[0].name in index["weight_map"].values()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_checkpoint_with_renamed_tensors_is_loaded_whole_and_says_so(tmp_path):
    from safetensors.torch import load_file, save_file

    dense = build("bert")
    dense.save_pretrained(tmp_path / "dense")
    stored = load_file(tmp_path / "dense" / "model.safetensors")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in stored.items()}  # older checkpoints' names, which transformers maps on load
    save_file(renamed, tmp_path / "dense" / "model.safetensors", metadata={"format": "pt"})
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert "streamed" not in result.report.extra
    assert any("under other names" in note and "loaded whole" in note for note in result.notes)
    reference = build("bert")
    comera_convert.convert(reference, ratio=2)
    loaded = tf.AutoModel.from_pretrained(tmp_path / "tt").eval()
    assert torch.allclose(outputs(loaded), outputs(reference.eval()), atol=1e-5)
