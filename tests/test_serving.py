"""Serving and inference paths on compressed checkpoints: transformers pipelines, generate() with the
KV cache, dtype= and device_map= on load, torch.compile, and ONNX export checked with onnxruntime."""

import pytest
import torch
import transformers as tf

import comera_convert
from comera_convert.layers import TTLinear

from .conftest import rel_err
from .tiny_models import build, inputs, outputs, word_tokenizer

PROMPT = "w5 w17 w3 w200"


def saved(case, tmp_path, ratio=3):
    """(compressed model, its checkpoint directory with a tokenizer)."""
    model = build(case)
    comera_convert.convert(model, ratio=ratio)
    path = tmp_path / case
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return model.eval(), path


def test_feature_extraction_pipeline(tmp_path):
    model, path = saved("bert", tmp_path)
    extract = tf.pipeline("feature-extraction", model=str(path))
    assert isinstance(extract.model.encoder.layer[0].attention.self.query, TTLinear)
    features = torch.tensor(extract(PROMPT))[0]
    batch = word_tokenizer()(PROMPT, return_tensors="pt")
    with torch.no_grad():
        expected = model(**batch).last_hidden_state[0]
    assert torch.allclose(features, expected, atol=1e-5)


def test_fill_mask_pipeline(tmp_path):
    model, path = saved("bert-mlm", tmp_path)
    fill = tf.pipeline("fill-mask", model=str(path), top_k=3)
    text = "w5 w17 [MASK] w200"
    batch = word_tokenizer()(text, return_tensors="pt")
    position = batch["input_ids"][0].tolist().index(word_tokenizer().mask_token_id)
    with torch.no_grad():
        logits = model(**batch).logits[0, position]
    assert [guess["token"] for guess in fill(text)] == logits.topk(3).indices.tolist()


@pytest.mark.parametrize("case", ["gpt2-clm", "llama-clm"])
def test_generate_with_the_kv_cache_equals_the_decompressed_model(case, tmp_path):
    model, path = saved(case, tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    dense = comera_convert.decompress_model(comera_convert.from_pretrained(path)).eval()
    ids = inputs()["input_ids"][:1, :6]
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    cached = loaded.generate(ids, use_cache=True, **settings)
    assert cached.shape[1] == 18
    assert torch.equal(cached, loaded.generate(ids, use_cache=False, **settings))
    assert torch.equal(cached, dense.generate(ids, **settings))


def test_text_generation_pipeline(tmp_path):
    model, path = saved("llama-clm", tmp_path)
    generate = tf.pipeline("text-generation", model=str(path))
    text = generate(PROMPT, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = word_tokenizer()(PROMPT, return_tensors="pt")["input_ids"]
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert text.split() == word_tokenizer().convert_ids_to_tokens(expected[0, ids.shape[1]:].tolist())


def test_dtype_and_device_map_on_load(tmp_path):
    model, path = saved("bert-mlm", tmp_path)
    half = tf.AutoModelForMaskedLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    query = half.bert.encoder.layer[0].attention.self.query
    assert {core.dtype for core in query.cores} == {torch.bfloat16}
    assert rel_err(outputs(half).float(), outputs(model)) < 2e-2
    mapped = tf.AutoModelForMaskedLM.from_pretrained(path, device_map="auto").eval()
    assert {p.device.type for p in mapped.parameters()} == {"cuda" if torch.cuda.is_available() else "cpu"}
    mapped.to("cpu")
    assert torch.equal(outputs(mapped), outputs(model))


@pytest.mark.slow
def _compiles_once(model) -> bool:
    import torch._dynamo

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = torch.compile(model)
            outputs(compiled), outputs(compiled)
    except torch._dynamo.exc.RecompileError:
        return False
    return True


@pytest.mark.slow  # a compilation end to end
@pytest.mark.ends
def test_torch_compile_of_a_loaded_model(tmp_path):
    import torch._dynamo

    _, path = saved("bert", tmp_path)
    loaded = tf.AutoModel.from_pretrained(path).eval()
    expected = outputs(loaded)
    # The inference cache must not retrace: checked where the dense model compiles once (torch 2.4's
    # dynamo recompiles transformers' own ModelOutput.__setitem__, dense or not).
    strict = _compiles_once(build("bert").eval())
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=strict):
        compiled = torch.compile(loaded)
        assert torch.allclose(outputs(compiled), expected, atol=1e-5)
        assert torch.allclose(outputs(compiled), expected, atol=1e-5)
