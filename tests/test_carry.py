"""Everything that is not a weight travels: conversion, training exports and decompression carry the
source's other files, and the model card is built on the source's card."""

import json
import logging
import os

import pytest
import torch
import transformers as tf

import comera_convert
from comera_convert.conversion import ConvertOptions
from comera_convert.hf.model_card import SOURCE_MARKER, parse_card, source_card
from comera_convert.api import convert_checkpoint, decompress

from .tiny_models import build, outputs

SOURCE_CARD = """---
license: mit
language: en
tags:
- text-generation
---

# A tiny test model

It was trained on nothing in particular.
"""
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture
def source_dir(tmp_path):
    """A dense GPT-2 checkpoint with the extras real ones carry, and some that must stay behind."""
    path = tmp_path / "source"
    model = build("gpt2-clm")
    model.generation_config = tf.GenerationConfig(max_new_tokens=7, eos_token_id=0, pad_token_id=0)
    model.save_pretrained(path)
    (path / "README.md").write_text(SOURCE_CARD)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "notes.dat").write_bytes(bytes(range(256)) * 4)  # unknown and binary: copied as is
    (path / "extras").mkdir()
    (path / "extras" / "about.txt").write_text("module folder contents")
    (path / "onnx").mkdir()  # the dense model in another runtime: never carried
    (path / "onnx" / "model.onnx").write_bytes(b"dense")
    (path / "pytorch_model.bin").write_bytes(b"dense weights in pickle form")
    (path / ".cache").mkdir()
    (path / "checkpoints" / "checkpoint-10").mkdir(parents=True)  # a training run's output
    (path / "comera_train_state.json").write_text("{}")
    os.symlink(path / "missing-target", path / "dangling.txt")  # unreadable: skipped with a warning
    return path


def test_conversion_carries_every_non_weight_file(source_dir, tmp_path, caplog):
    out = tmp_path / "tt"
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        convert_checkpoint(str(source_dir), out, ConvertOptions(ratio=2), command="comera convert source --ratio 2")
    names = {p.name for p in out.iterdir()}
    assert {"chat_template.jinja", "notes.dat", "extras", "generation_config.json"} <= names
    assert not names & {"onnx", "pytorch_model.bin", ".cache", "dangling.txt", "checkpoints", "comera_train_state.json"}
    assert (out / "notes.dat").read_bytes() == (source_dir / "notes.dat").read_bytes()
    assert (out / "extras" / "about.txt").read_text() == "module folder contents"
    assert "did not carry dangling.txt" in caplog.text
    # transformers' own generation config is that of the saved model: the source's settings kept.
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 7
    loaded = comera_convert.from_pretrained(out)
    assert loaded.generation_config.max_new_tokens == 7


def test_model_card_states_source_licence_method_bytes_and_command(source_dir, tmp_path):
    out = tmp_path / "tt"
    result = convert_checkpoint(str(source_dir), out, ConvertOptions(ratio=2),
                                command="comera convert source --ratio 2")
    text = (out / "README.md").read_text()
    card = parse_card(text)
    assert card.metadata["license"] == "mit"
    assert {"text-generation", "comera_convert"} <= set(card.metadata["tags"])
    ours, theirs = card.body.split(SOURCE_MARKER)
    assert "| licence (of the source) | mit |" in ours
    assert f"{result.report.ratio:.2f}x smaller" in ours
    assert "plain TT-SVD" in ours and "`comera convert source --ratio 2`" in ours
    assert "weights on disk" in ours and "comera eval" in ours
    assert "# A tiny test model" in theirs
    # The card of the card: a further step finds the source's card, not comera's.
    again = source_card(out)
    assert again.metadata["tags"] == ["text-generation"] and again.body.startswith("# A tiny test model")


def test_decompress_carries_the_files_and_restores_the_source_card(source_dir, tmp_path):
    compressed = tmp_path / "tt"
    convert_checkpoint(str(source_dir), compressed, ConvertOptions(ratio=2))
    dense = decompress(str(compressed), tmp_path / "dense")
    names = {p.name for p in dense.iterdir()}
    assert {"chat_template.jinja", "notes.dat", "extras", "README.md"} <= names
    assert not names & {"comera_report.json", "comera_remote.py"}
    card = parse_card((dense / "README.md").read_text())
    assert card.metadata["license"] == "mit" and "comera_convert" not in card.metadata["tags"]
    assert "Dense expansion" in card.body and "# A tiny test model" in card.body
    plain = tf.AutoModelForCausalLM.from_pretrained(dense).eval()
    expected = outputs(comera_convert.from_pretrained(compressed).eval())
    assert torch.allclose(outputs(plain), expected, rtol=1e-4, atol=1e-5)


def test_lineage_of_a_trained_checkpoint_keeps_how_it_was_made(tmp_path):
    from comera_convert.conversion.report import ConversionReport, lineage

    previous = ConversionReport("BertModel", 10, 5, extra={
        "calibration": "english", "commands": ["comera convert x"], "eval": {"stale": True}, "timings": {}})
    extra = lineage(previous, "comera train y")
    assert extra == {"calibration": "english", "commands": ["comera convert x", "comera train y"]}


def test_a_user_save_keeps_the_source_card_of_the_loaded_checkpoint(source_dir, tmp_path):
    compressed = tmp_path / "tt"
    convert_checkpoint(str(source_dir), compressed, ConvertOptions(ratio=2))
    model = tf.AutoModelForCausalLM.from_pretrained(compressed)
    model.save_pretrained(tmp_path / "again")
    assert "# A tiny test model" in (tmp_path / "again" / "README.md").read_text()
