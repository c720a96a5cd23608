"""Tiny seeded models from configs, one per (architecture, head): the converter's test matrix."""

import torch
import transformers as tf

VOCAB = 512  # 2^9: modes need no padding; the padding path is tested with 30522-like sizes elsewhere


def _bert():
    return tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         vocab_size=VOCAB, max_position_embeddings=64)


def _roberta():
    return tf.RobertaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=VOCAB, max_position_embeddings=66)


def _distilbert():
    return tf.DistilBertConfig(dim=64, hidden_dim=128, n_layers=2, n_heads=4, vocab_size=VOCAB,
                               max_position_embeddings=64)


def _gpt2():
    return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _llama():
    return tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _mistral():
    return tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0)


# (case id, config factory, model class): base models and models with heads.
CASES = [
    ("bert", _bert, tf.BertModel),
    ("bert-mlm", _bert, tf.BertForMaskedLM),
    ("bert-seqcls", _bert, tf.BertForSequenceClassification),
    ("roberta-mlm", _roberta, tf.RobertaForMaskedLM),
    ("distilbert-mlm", _distilbert, tf.DistilBertForMaskedLM),
    ("gpt2", _gpt2, tf.GPT2Model),
    ("gpt2-clm", _gpt2, tf.GPT2LMHeadModel),
    ("gpt2-seqcls", _gpt2, tf.GPT2ForSequenceClassification),
    ("llama-clm", _llama, tf.LlamaForCausalLM),
    ("mistral-clm", _mistral, tf.MistralForCausalLM),
]
CASE_IDS = [case[0] for case in CASES]


def build(case_id: str, seed: int = 0):
    factory, cls = next((f, c) for i, f, c in CASES if i == case_id)
    torch.manual_seed(seed)
    return cls(factory()).eval()


def inputs(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 12), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def outputs(model, batch=None):
    """The tensor a model's users look at: logits, or the last hidden state."""
    with torch.no_grad():
        out = model(**(batch or inputs()))
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


SPECIAL_TOKENS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                  "mask_token": "[MASK]"}


def word_tokenizer(size: int = VOCAB):
    """A word-level tokenizer over the tiny models' vocabulary (``size`` tokens): [PAD] (id 0, also the
    causal models' end of text), the other special tokens, then the words w0, w1, ... split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = list(SPECIAL_TOKENS.values())
    words = [f"w{i}" for i in range(size - len(specials))]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)


def serving_checkpoint(tmp_path):
    """A converted tiny BERT with its tokenizer, its dense source, and 12 query/document pairs of its words:
    (checkpoint, dense, pairs file), for the serving benchmarks."""
    import json

    import comera_convert

    dense = build("bert")
    dense.save_pretrained(tmp_path / "dense")
    model = build("bert")
    comera_convert.convert(model, ratio=3)
    model.save_pretrained(tmp_path / "tt")
    word_tokenizer().save_pretrained(tmp_path / "tt")
    pairs = tmp_path / "words.jsonl"
    generator = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(12):
        words = [f"w{int(i)}" for i in torch.randint(10, 400, (10,), generator=generator)]
        lines.append(json.dumps({"query": " ".join(words[:4]), "document": " ".join(words)}))
    pairs.write_text("\n".join(lines))
    return tmp_path / "tt", tmp_path / "dense", pairs
