"""ONNX export of compressed checkpoints: the graph stays compressed and onnxruntime agrees with PyTorch."""

import json
import math
import re
import subprocess
import sys

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import comera_convert
from comera_convert.cli import main
from comera_convert.errors import ConfigError, ModelLoadError
from comera_convert.hf.export import export_model

from .tiny_models import build, inputs, outputs, serving_checkpoint, word_tokenizer

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
    result = export_model(str(path), tmp_path / "onnx", forms="pair")
    assert result.max_difference is not None and result.max_difference < 1e-4
    assert result.graphs == [tmp_path / "onnx" / "onnx" / "model.onnx"]  # where sentence-transformers looks
    # weights inside, and the forms the pairs serve in beside it
    assert sorted(p.name for p in result.graphs[0].parent.iterdir()) == ["model.onnx", "serving_forms.json"]
    session = ort.InferenceSession(str(result.graphs[0]), providers=["CPUExecutionProvider"])
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
    assert stored_values(result.graphs[0]) < (0.6 if layout == "tt" else 0.9) * dense_params + folded
    assert (layout == "ttm") == any("ttm" in note for note in result.notes)
    assert (result.out / "tokenizer.json").is_file()
    assert "quantization_config" not in (result.out / "config.json").read_text()


def test_requests_that_cannot_work_are_refused_before_writing(tmp_path):
    _, path, _ = saved("bert", tmp_path)
    with pytest.raises(ConfigError, match="writes opset 18 or later"):
        export_model(str(path), tmp_path / "a", opset=13)
    with pytest.raises(ConfigError, match="takes float32 or float16"):
        export_model(str(path), tmp_path / "b", dtype="bfloat16")
    with pytest.raises(ConfigError, match="int8 quantization starts from the float32 graph"):
        export_model(str(path), tmp_path / "b", dtype="float16", quantize="int8")
    arch_error = "--arch: expected one of avx512_vnni, avx512, avx2, arm64 (got 'sse4')"
    with pytest.raises(ConfigError, match=re.escape(arch_error)):
        export_model(str(path), tmp_path / "b", quantize="int8", arch="sse4")
    _, bare, _ = saved("bert-mlm", tmp_path, tokenizer=False)
    with pytest.raises(ModelLoadError, match="ONNX export needs the model's tokenizer"):
        export_model(str(bare), tmp_path / "c")
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.slow
def test_cli_exports_minilm_a_quarter_of_the_dense_size(tmp_path, minilm_tt4_plain):
    from comera_convert.models import packaged_minilm

    done = subprocess.run([sys.executable, "-m", "comera_convert", "export-onnx", str(minilm_tt4_plain),
                           "--out", str(tmp_path / "onnx")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "onnxruntime agrees with PyTorch" in done.stdout
    exported = (tmp_path / "onnx" / "onnx" / "model.onnx").stat().st_size
    assert exported < 0.3 * (packaged_minilm() / "model.safetensors").stat().st_size


def sentence_folder(tmp_path):
    """A converted tiny BERT saved as a sentence-transformers model: modules.json and a pooling folder."""
    import json

    model, path, _ = saved("bert", tmp_path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                "pooling_mode_mean_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    return model, path


def test_int8_export_goes_into_the_checkpoint_as_sentence_transformers_names_it(tmp_path):
    model, path = sentence_folder(tmp_path)
    result = export_model(str(path), quantize="int8", arch="avx2", forms="pair")
    assert result.out == path and result.notes == []
    assert result.graphs == [path / "onnx" / "model.onnx", path / "onnx" / "model_quint8_avx2.onnx"]
    assert result.graphs[1].stat().st_size < 0.8 * result.graphs[0].stat().st_size  # weights in int8, not all
    batch = inputs(seed=3)
    expected = outputs(model, batch)
    session = ort.InferenceSession(str(result.graphs[1]), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {i.name: batch[i.name].numpy() for i in session.get_inputs()})[0])
    assert 0 < float((got - expected).norm() / expected.norm()) < 0.05  # rounded, yet the same function
    assert 0 < result.int8_difference < 0.05
    with pytest.raises(ConfigError, match="onnx exists: pass --overwrite to replace it, or give --out"):
        export_model(str(path), quantize="int8", arch="avx2")
    # replaced whole: the int8 graph goes with the old folder
    again = export_model(str(path), overwrite=True, forms="pair")
    assert sorted(p.name for p in (path / "onnx").iterdir()) == ["model.onnx", "serving_forms.json"]
    assert len(again.graphs) == 1


def test_a_copy_holds_what_sentence_transformers_loads_and_no_pytorch_weights(tmp_path):
    _, path = sentence_folder(tmp_path)
    result = export_model(str(path), tmp_path / "served", quantize="int8", arch="avx512_vnni")
    served = tmp_path / "served"
    assert {p.name for p in served.iterdir()} >= {"modules.json", "1_Pooling", "sentence_bert_config.json",
                                                   "config.json", "tokenizer.json", "onnx"}
    assert not list(served.glob("*.safetensors")) and not (path / "onnx").exists()
    assert (served / "1_Pooling" / "config.json").read_text() == (path / "1_Pooling" / "config.json").read_text()
    assert "quantization_config" not in (served / "config.json").read_text()
    assert [g.name for g in result.graphs] == ["model.onnx", "model_qint8_avx512_vnni.onnx"]
    from transformers import AutoTokenizer  # the copy's tokenizer under a class name transformers 4 and 5 know

    assert '"PreTrainedTokenizerFast"' in (served / "tokenizer_config.json").read_text()
    text = "w11 w12 w13"
    assert AutoTokenizer.from_pretrained(served)(text) == AutoTokenizer.from_pretrained(path)(text)


def test_a_model_without_modules_json_is_exported_with_a_note_on_pooling(tmp_path):
    _, path, _ = saved("bert", tmp_path)
    result = export_model(str(path), tmp_path / "out", forms="pair")
    assert result.notes == ["not a sentence-transformers model (no modules.json): the graphs give token states, "
                            "and pooling is not in them"]


def test_int8_preparation_quantizes_a_weight_the_graph_computes_from_constants(tmp_path):
    """A factor the exporter writes as a constant reshaped (or gated) inside the graph, multiplied by Gemm:
    the plain quantizer leaves it float, the prepared graph has it in int8 and computes the same."""
    import collections

    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from comera_convert.hf.onnx_int8 import quantize_int8, this_machine_arch

    rng = np.random.default_rng(0)
    core, bias = rng.standard_normal((2, 8, 6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["core", "shape"], ["weight"]),
         helper.make_node("Gemm", ["x", "weight", "bias"], ["y"])], "factor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6])],
        [numpy_helper.from_array(core, "core"), numpy_helper.from_array(np.array([16, 6], np.int64), "shape"),
         numpy_helper.from_array(bias, "bias")])
    source = tmp_path / "factor.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(source))
    x = rng.standard_normal((5, 16)).astype(np.float32)
    expected = x @ core.reshape(16, 6) + bias
    quantized = {}
    for prepare in (False, True):
        file = tmp_path / f"int8-{prepare}.onnx"
        # For the CPU it runs on: a graph for avx512_vnni (signed int8 weights) runs on an AVX2-only CPU
        # through onnxruntime's 16-bit pair sums, which saturate.
        quantize_int8(source, file, this_machine_arch(), prepare=prepare)
        quantized[prepare] = collections.Counter(node.op_type for node in onnx.load(str(file)).graph.node)
        got = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()
    assert quantized[False]["MatMulInteger"] == 0 and quantized[False]["MatMul"] + quantized[False]["Gemm"] == 1
    assert quantized[True]["MatMulInteger"] == 1 and quantized[True]["MatMul"] + quantized[True]["Gemm"] == 0


def test_the_export_uses_plain_attention_and_gives_the_model_back_as_it_was(tmp_path):
    from comera_convert.hf.onnx_export import eager_attention

    model, _, _ = saved("bert", tmp_path)
    model.set_attn_implementation("sdpa")
    with eager_attention(model):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "sdpa"


def test_bench_serving_adds_onnx_runtime_float_and_int8_for_both_models(tmp_path):
    pytest.importorskip("onnxruntime")
    checkpoint, dense, pairs = serving_checkpoint(tmp_path)
    result = CliRunner().invoke(main, ["bench", "serving", "--checkpoint", str(checkpoint), "--reference", str(dense),
                                       "--pairs", str(pairs), "--texts", "12", "--repeats", "1", "--json",
                                       "--forms", "pair"])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads(result.output)["rows"]}
    onnx_rows = [name for name in rows if "ONNX Runtime" in name]
    assert onnx_rows == ["dense, ONNX Runtime", "dense, ONNX Runtime int8 (sentence-transformers' quantization)",
                         "comera, ONNX Runtime", "comera, ONNX Runtime int8"]
    # the float graphs compute what PyTorch does: the same retrieval as their PyTorch models
    assert rows["dense, ONNX Runtime"]["recall_kept"] == {"words": 1.0}
    assert rows["comera, ONNX Runtime"]["recall_kept"] == rows["comera float32"]["recall_kept"]
    assert all(row["case"] == "serving" for row in rows.values())
    for row in rows.values():  # one round: each speed against dense is the ratio of the timings
        assert row["speed_vs_dense"] == pytest.approx(row["sentences_per_s"] / rows["dense"]["sentences_per_s"],
                                                      rel=0.01, abs=0.01)
    assert rows["comera, ONNX Runtime int8"]["file_mb"] < rows["comera, ONNX Runtime"]["file_mb"]
    assert "file_mb" not in rows["dense"]
    # each compressed graph says the forms its layers serve in (--forms pair: two int8 products per pair)
    assert rows["comera, ONNX Runtime int8"]["forms"].startswith("pair/int8 x")
    assert rows["comera, ONNX Runtime"]["forms"].startswith("pair/float x")
    assert "forms" not in rows["dense, ONNX Runtime"]


def test_bench_serving_times_a_graph_made_elsewhere_beside_its_own(tmp_path):
    pytest.importorskip("onnxruntime")
    from comera_convert.hf.export import export_model

    checkpoint, dense, pairs = serving_checkpoint(tmp_path)
    # the compressed float graph, made apart
    peer = export_model(str(checkpoint), tmp_path / "peer", forms="pair").graphs[0]
    result = CliRunner().invoke(main, ["bench", "serving", "--checkpoint", str(checkpoint), "--reference", str(dense),
                                       "--pairs", str(pairs), "--texts", "12", "--repeats", "1", "--json",
                                       "--peer", str(peer), "--batch", "1", "--forms", "pair"])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads(result.output)["rows"]}
    assert rows["peer: onnx/model.onnx"]["recall_kept"] == rows["comera, ONNX Runtime"]["recall_kept"]
    assert all(row["shape"].endswith("batch 1") for row in rows.values())  # one text at a time
    refused = CliRunner().invoke(main, ["bench", "inference", "--checkpoint", str(checkpoint),
                                        "--peer", str(peer)])
    assert refused.exit_code == 1 and "--peer adds a graph to the serving case" in refused.output


def test_int8_rounding_that_strays_far_is_written_with_a_note_and_a_wrong_graph_is_refused():
    from comera_convert.hf.export import _int8_notes
    from comera_convert.hf.onnx_export import OnnxExport, relative_error

    expected = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    assert relative_error(expected * 1.01, expected, "the int8 graph") == pytest.approx(0.01, rel=1e-4)
    with pytest.raises(ConfigError, match="the int8 graph strays from PyTorch: relative error"):
        relative_error(-expected, expected, "the int8 graph")  # another function: twice the states' norm
    far = OnnxExport(out=Path('.'), output_name="last_hidden_state", opset=18, max_difference=0.0,
                     int8_difference=0.57)
    assert _int8_notes(far) == ["int8 rounding moved the hidden states by 57% of their norm on the sample: measure "
                                "the retrieval it keeps before serving it (comera bench serving --checkpoint)"]
    assert _int8_notes(OnnxExport(out=Path('.'), output_name="x", opset=18, max_difference=0.0,
                                  int8_difference=0.05)) == []
