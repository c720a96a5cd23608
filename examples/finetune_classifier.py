"""Fine-tune a compressed encoder on a downstream task: all-MiniLM-L6-v2 4x smaller, a sequence
classification head, and LoRA adapters on its TT layers, trained with transformers' Trainer.

The task is offline and real: tell prose (the built-in `english` corpus) from code (`python-stdlib`),
measured on their held-out documents.

    pip install -e ".[demo,peft]" && python examples/finetune_classifier.py [--full]

--full trains every parameter (TT cores included) instead of LoRA adapters.
"""

import sys
import tempfile

import torch
from peft import get_peft_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

import comera_convert
from comera_convert import ConvertRequest
from comera_convert.text import documents, is_held_out
from comera_convert.api import convert_checkpoint

TEXTS_PER_CLASS = 256
LABELS = {"english": 0, "python-stdlib": 1}


def rows(tokenizer, held_out: bool, count: int):
    """Tokenized first 400 characters of ``count`` documents per class."""
    texts, labels = [], []
    for source, label in LABELS.items():
        picked = [t[:400] for i, t in enumerate(documents(source)) if is_held_out(i) == held_out][:count]
        texts += picked
        labels += [label] * len(picked)
    encoded = tokenizer(texts, truncation=True, max_length=64, padding="max_length", return_tensors="pt")
    return [{"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(label)}
            for ids, mask, label in zip(encoded["input_ids"], encoded["attention_mask"], labels)]


def accuracy(model, data) -> float:
    batch = {k: torch.stack([r[k] for r in data]) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        predicted = model.eval()(**batch).logits.argmax(-1)
    return float((predicted == torch.stack([r["labels"] for r in data])).float().mean())


def main(full: bool) -> None:
    with tempfile.TemporaryDirectory() as work:
        convert_checkpoint("minilm", f"{work}/minilm-tt4", ConvertRequest(ratio=4),
                           default_calibration=None)  # plain TT-SVD, seconds
        tokenizer = AutoTokenizer.from_pretrained(f"{work}/minilm-tt4")
        torch.manual_seed(0)  # the new classification head starts the same every run
        model = AutoModelForSequenceClassification.from_pretrained(f"{work}/minilm-tt4", num_labels=2)
        if not full:
            config = comera_convert.lora_config(r=8, target_modules=["query", "value"],
                                                modules_to_save=["classifier"], task_type="SEQ_CLS")
            model = get_peft_model(model, config)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"{'all' if full else 'LoRA'} parameters trained: {trainable:,}")
        train, test = rows(tokenizer, False, TEXTS_PER_CLASS), rows(tokenizer, True, 64)
        print(f"held-out accuracy before: {accuracy(model, test):.3f}")
        args = TrainingArguments(output_dir=f"{work}/run", max_steps=60, per_device_train_batch_size=16,
                                 learning_rate=1e-4 if full else 1e-3, report_to=[], save_strategy="no",
                                 use_cpu=not torch.cuda.is_available(), logging_steps=20)
        Trainer(model=model, args=args, train_dataset=train).train()
        print(f"held-out accuracy after:  {accuracy(model, test):.3f}")
        model.save_pretrained(f"{work}/finetuned")  # an adapter folder, or a compressed checkpoint (--full)


if __name__ == "__main__":
    main(full="--full" in sys.argv)
