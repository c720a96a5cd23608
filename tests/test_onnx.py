"""ONNX export of compressed checkpoints: the graph stays compressed and onnxruntime agrees with PyTorch."""

import math
import subprocess
import sys

import pytest
import torch

import comera_convert
from comera_convert.errors import ConfigError, ModelLoadError
from comera_convert.hf.onnx_export import export_onnx

from .tiny_models import build, inputs, outputs, word_tokenizer

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def saved(case, tmp_path, tokenizer=True, layout="tt"):
    model = build(case)
    dense_params = sum(p.numel() for p in model.parameters())
    comera_convert.convert(model, ratio=3, layout=layout, embedding_layout=layout)
    path = tmp_path / case
    model.save_pretrained(path)
    if tokenizer:
        word_tokenizer().save_pretrained(path)
    return model.eval(), path, dense_params


def stored_values(file) -> int:
    graph = onnx.load(str(file)).graph  # external data is read alongside
    return sum(math.prod(t.dims) for t in graph.initializer)


# An encoder and a causal LM in the fast suite; the ttm layout and Llama's attention with the slow tests.
@pytest.mark.parametrize("case, layout", [("bert", "tt"), pytest.param("bert-mlm", "ttm", marks=pytest.mark.slow),
                                          ("gpt2-clm", "tt"), pytest.param("llama-clm", "tt", marks=pytest.mark.slow)])
def test_exported_graph_agrees_with_pytorch_on_new_shapes_and_stays_compressed(case, layout, tmp_path):
    model, path, dense_params = saved(case, tmp_path, layout=layout)
    result = export_onnx(str(path), tmp_path / "onnx")
    assert result.max_difference is not None and result.max_difference < 1e-4
    session = ort.InferenceSession(str(result.out / "model.onnx"), providers=["CPUExecutionProvider"])
    batch = inputs(seed=5)  # another batch and length than the export's sample
    batch = {k: v[:, :7].repeat(2, 1)[:3] for k, v in batch.items()}
    got = session.run(None, {i.name: batch[i.name].numpy() for i in session.get_inputs()})[0]
    assert torch.allclose(torch.from_numpy(got), outputs(model, batch), atol=1e-4)
    # The graph holds cores or the halves the exporter's optimizer folds them into, never the dense
    # weights (ttm's folded partial products outgrow its cores at this tiny size, not at MiniLM's).
    # Known exception: a head tied to a codebook table (GPT-2's) multiplies by its dequantized rows,
    # which the exporter folds into one vocab x width table.
    table = model.get_input_embeddings()
    folded = table.num_embeddings * table.embedding_dim if case == "gpt2-clm" and layout == "tt" else 0
    assert stored_values(result.out / "model.onnx") < (0.6 if layout == "tt" else 0.9) * dense_params + folded
    assert (layout == "ttm") == any("ttm" in note for note in result.notes)
    assert (result.out / "tokenizer.json").is_file()
    assert "quantization_config" not in (result.out / "config.json").read_text()


def test_requests_that_cannot_work_are_refused_before_writing(tmp_path):
    _, path, _ = saved("bert", tmp_path)
    with pytest.raises(ConfigError, match="writes opset 18 or later"):
        export_onnx(str(path), tmp_path / "a", opset=13)
    with pytest.raises(ConfigError, match="takes float32 or float16"):
        export_onnx(str(path), tmp_path / "b", dtype="bfloat16")
    _, bare, _ = saved("bert-mlm", tmp_path, tokenizer=False)
    with pytest.raises(ModelLoadError, match="ONNX export needs the model's tokenizer"):
        export_onnx(str(bare), tmp_path / "c")
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.slow
def test_cli_exports_minilm_a_quarter_of_the_dense_size(tmp_path, minilm_tt4_plain):
    from comera_convert.models import packaged_minilm

    done = subprocess.run([sys.executable, "-m", "comera_convert", "export-onnx", str(minilm_tt4_plain),
                           "--out", str(tmp_path / "onnx")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "onnxruntime agrees with PyTorch" in done.stdout
    exported = sum(f.stat().st_size for f in (tmp_path / "onnx").glob("model.onnx*"))
    assert exported < 0.3 * (packaged_minilm() / "model.safetensors").stat().st_size
