"""Fine-tuning on top of a compressed checkpoint: a classification head with Trainer, and peft LoRA
adapters on its TT and dense layers."""

import pytest
import torch
import transformers as tf

import comera_convert
from comera_convert.errors import ConfigError
from comera_convert.layers import TTLinear

from .tiny_models import VOCAB, build, word_tokenizer

peft = pytest.importorskip("peft")
SIGNAL = 7  # a text is positive when it holds token w7: learnable in a few dozen steps


def compressed_encoder(tmp_path, **convert_options):
    model = build("bert")
    comera_convert.convert(model, ratio=3, **convert_options)
    path = tmp_path / "bert-tt"
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def task(count=64, seed=0):
    """Rows of 12 random words; half of them get w7 somewhere, and label 1."""
    generator = torch.Generator().manual_seed(seed)
    signal = word_tokenizer().convert_tokens_to_ids(f"w{SIGNAL}")
    rows = []
    for i in range(count):
        ids = torch.randint(signal + 1, VOCAB, (12,), generator=generator)
        if i % 2:
            ids[int(torch.randint(0, 12, (1,), generator=generator))] = signal
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor(i % 2)})
    return rows


def accuracy(model, rows) -> float:
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        predicted = model.eval()(**batch).logits.argmax(-1)
    return float((predicted == torch.stack([r["labels"] for r in rows])).float().mean())


def fit(model, tmp_path, steps=100, lr=3e-3):
    args = tf.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=steps, per_device_train_batch_size=16,
                                learning_rate=lr, report_to=[], use_cpu=True, save_strategy="no", seed=0)
    tf.Trainer(model=model, args=args, train_dataset=task(count=1024)).train()
    return model


def test_a_classification_head_fine_tunes_on_a_compressed_encoder(tmp_path):
    path = compressed_encoder(tmp_path)
    model = tf.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    query = model.bert.encoder.layer[0].attention.self.query
    assert isinstance(query, TTLinear)
    cores = [c.detach().clone() for c in query.cores]
    fit(model, tmp_path)
    assert accuracy(model, task(seed=1)) >= 0.9  # held-out rows
    assert any(not torch.equal(a, b) for a, b in zip(cores, query.cores))  # the TT layers trained too
    model.save_pretrained(tmp_path / "classifier")
    reloaded = tf.AutoModelForSequenceClassification.from_pretrained(tmp_path / "classifier")
    rows = task(seed=2)[:8]
    assert torch.equal(reloaded.eval()(**{k: torch.stack([r[k] for r in rows]) for k in ("input_ids",)}).logits,
                       model.eval()(**{k: torch.stack([r[k] for r in rows]) for k in ("input_ids",)}).logits)


def test_lora_adapters_on_tt_layers_train_save_and_load(tmp_path):
    path = compressed_encoder(tmp_path)
    base = tf.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    config = comera_convert.lora_config(r=4, target_modules=["query", "value"], modules_to_save=["classifier"],
                                        task_type="SEQ_CLS")
    model = peft.get_peft_model(base, config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "classifier" in n for n in trainable)
    query = model.base_model.model.bert.encoder.layer[0].attention.self.query
    cores = [c.detach().clone() for c in query.base_layer.cores]
    fit(model, tmp_path, lr=1e-2)
    assert accuracy(model, task(seed=1)) >= 0.9
    assert all(torch.equal(a, b) for a, b in zip(cores, query.base_layer.cores))  # frozen under the adapter
    model.save_pretrained(tmp_path / "adapter")

    fresh = tf.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    loaded = comera_convert.load_lora(fresh, tmp_path / "adapter")
    rows = task(seed=2)[:8]
    batch = {"input_ids": torch.stack([r["input_ids"] for r in rows])}
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(**batch).logits, model.eval()(**batch).logits, atol=1e-6)


def test_merging_into_a_tt_layer_is_refused_and_dense_layers_merge(tmp_path):
    path = compressed_encoder(tmp_path, exclude=["*.output.dense"])  # FFN and attention outputs stay dense
    base = tf.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    tt_adapted = peft.get_peft_model(base, comera_convert.lora_config(r=4, target_modules=["query"]))
    with pytest.raises(ConfigError, match="cannot be merged into a tensor-train layer"):
        tt_adapted.merge_and_unload()

    base = tf.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    dense_adapted = peft.get_peft_model(base, comera_convert.lora_config(r=4, target_modules=["output.dense"],
                                                                         init_lora_weights=False))
    batch = {"input_ids": torch.stack([r["input_ids"] for r in task()[:4]])}
    with torch.no_grad():
        expected = dense_adapted.eval()(**batch).logits
        merged = dense_adapted.merge_and_unload()
        assert torch.allclose(merged(**batch).logits, expected, atol=1e-5)
    assert isinstance(merged.bert.encoder.layer[0].attention.self.query, TTLinear)
