"""OpenVINO export of compressed checkpoints: where sentence-transformers' openvino backend looks, float and
int8, each graph computing what PyTorch does."""

import json
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from comera_convert.cli import main
from comera_convert.errors import ConfigError
from comera_convert.hf.export import export_model

from .test_onnx import sentence_folder
from .tiny_models import inputs, outputs, serving_checkpoint

openvino = pytest.importorskip("openvino")
pytest.importorskip("nncf")
pytest.importorskip("onnxruntime")


def run(file, batch, precision=None):
    from comera_convert.hf.runtimes import compile_graph, run_graph

    compiled = compile_graph(file, {"INFERENCE_PRECISION_HINT": precision} if precision else None)
    return torch.from_numpy(run_graph(compiled, {name: value.numpy() for name, value in batch.items()}))


def test_openvino_graphs_go_where_sentence_transformers_looks_and_compute_what_pytorch_does(tmp_path):
    model, path = sentence_folder(tmp_path)
    # every pair as two linears, every layer in int8 (with the default, layers that time faster in float
    # stay float: on some CPUs every one of this tiny model's)
    result = export_model(str(path), tmp_path / "served", quantize="int8", fmt="openvino", forms="pair")
    served = tmp_path / "served"
    assert result.graphs == [served / "openvino" / "openvino_model.xml",
                             served / "openvino" / "openvino_model_qint8_quantized.xml"]
    assert sorted(p.name for p in (served / "openvino").iterdir()) == [
        "openvino_model.bin", "openvino_model.xml", "openvino_model_qint8_quantized.bin",
        "openvino_model_qint8_quantized.xml", "serving_forms.json"]
    plans = json.loads((served / "openvino" / "serving_forms.json").read_text())["graphs"]
    assert list(plans) == ["openvino_model.xml", "openvino_model_qint8_quantized.xml"]
    assert {group["chosen"] for group in plans["openvino_model_qint8_quantized.xml"]["groups"]} <= {
        "pair/int8", "linear/int8"}
    assert not (served / "onnx").exists() and not list(served.glob("*.safetensors"))
    assert {"modules.json", "1_Pooling", "config.json", "tokenizer.json"} <= {p.name for p in served.iterdir()}
    assert result.checked_by == "OpenVINO" and result.max_difference < 1e-4
    for graph in result.graphs:  # the output optimum-intel (sentence-transformers' backend) reads by name
        assert "last_hidden_state" in openvino.Core().read_model(graph).outputs[0].get_names()
    batch = inputs(seed=4)  # another batch and length than the export's sample
    batch = {k: v[:, :9].repeat(2, 1)[:3] for k, v in batch.items()}
    expected = outputs(model, batch)
    assert torch.allclose(run(result.graphs[0], batch, "f32"), expected, atol=1e-4)
    int8 = run(result.graphs[1], batch)
    assert 0 < float((int8 - expected).norm() / expected.norm()) < 0.05  # rounded, yet the same function
    assert 0 < result.int8_difference < 0.05
    # int8 weights: the quantized graph's weight file is well under the float one's
    assert (served / "openvino" / "openvino_model_qint8_quantized.bin").stat().st_size < \
        0.6 * (served / "openvino" / "openvino_model.bin").stat().st_size


def test_the_default_forms_are_timed_here_and_each_is_the_fastest_measured(tmp_path):
    from comera_convert.hf.form_timing import default_choice, plan_forms

    model, _ = sentence_folder(tmp_path)
    plan = plan_forms(model, "openvino", True, rounds=2)
    timed = [group for group in plan.groups if group.milliseconds]
    assert timed
    for group in timed:  # the fastest, or the default where the rounds' spread exceeds the fastest's lead
        fastest = min(group.milliseconds, key=group.milliseconds.get)
        assert group.chosen == fastest or (group.noisy and group.chosen == default_choice(group.shape, True))


def test_openvino_export_into_the_checkpoint_replaces_only_its_openvino_folder(tmp_path):
    _, path = sentence_folder(tmp_path)
    export_model(str(path), fmt="onnx", forms="pair")
    result = export_model(str(path), fmt="openvino", forms="pair")
    assert result.graphs == [path / "openvino" / "openvino_model.xml"]
    assert (path / "onnx" / "model.onnx").is_file()  # the ONNX graph stays beside it
    with pytest.raises(ConfigError, match="openvino exists: pass --overwrite to replace it, or give --out"):
        export_model(str(path), fmt="openvino")


def test_openvino_requests_that_cannot_work_are_refused_before_writing(tmp_path, monkeypatch):
    _, path = sentence_folder(tmp_path)
    with pytest.raises(ConfigError, match="--format openvino with --dtype float16: OpenVINO graphs are written in "
                                          "float32"):
        export_model(str(path), tmp_path / "a", fmt="openvino", dtype="float16")
    with pytest.raises(ConfigError, match="--arch avx2 names an ONNX int8 file"):
        export_model(str(path), tmp_path / "a", fmt="openvino", quantize="int8", arch="avx2")
    with pytest.raises(ConfigError, match="--format tflite: graphs are written for onnx or openvino"):
        export_model(str(path), tmp_path / "a", fmt="tflite")
    monkeypatch.setitem(sys.modules, "nncf", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"--format openvino needs openvino and nncf: pip install "
                                          r"'comera-convert\[openvino\]'"):
        export_model(str(path), tmp_path / "a", fmt="openvino")
    assert not (tmp_path / "a").exists() and not (path / "openvino").exists()


def test_cli_export_says_which_runtime_checked_and_the_earlier_name_still_works(tmp_path):
    _, path = sentence_folder(tmp_path)
    result = CliRunner().invoke(main, ["export", str(path), "--format", "openvino", "--out", str(tmp_path / "ov"),
                                       "--forms", "pair"])
    assert result.exit_code == 0, result.output
    assert "OpenVINO agrees with PyTorch" in result.output
    earlier = CliRunner().invoke(main, ["export-onnx", str(path), "--out", str(tmp_path / "o"), "--forms", "pair"])
    assert earlier.exit_code == 0, earlier.output
    assert "onnxruntime agrees with PyTorch" in earlier.output and (tmp_path / "o" / "onnx" / "model.onnx").is_file()
    assert "export-onnx" not in CliRunner().invoke(main, ["--help"]).output  # one name in the list


@pytest.mark.slow  # four exports and their int8 calibrations, then every method timed
def test_bench_serving_adds_openvino_float_and_int8_and_a_peer_graph(tmp_path):
    checkpoint, dense, pairs = serving_checkpoint(tmp_path)
    peer = export_model(str(checkpoint), tmp_path / "peer", fmt="openvino").graphs[0]  # made apart
    result = CliRunner().invoke(main, ["bench", "serving", "--checkpoint", str(checkpoint), "--reference", str(dense),
                                       "--pairs", str(pairs), "--texts", "12", "--repeats", "1", "--json",
                                       "--peer", str(peer)])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads(result.output)["rows"]}
    assert {"dense, OpenVINO", "dense, OpenVINO int8 (NNCF, as sentence-transformers quantizes)",
            "comera, OpenVINO", "comera, OpenVINO int8", "peer: openvino/openvino_model.xml"} <= set(rows)
    assert rows["comera, OpenVINO int8"]["file_mb"] > 0 and "file_mb" not in rows["dense"]  # graph and weights
    assert all(np.isfinite(row["sentences_per_s"]) and row["sentences_per_s"] > 0 for row in rows.values())
    # OpenVINO computes in bfloat16 where the CPU has it: the same retrieval, give or take rounding
    assert rows["dense, OpenVINO"]["recall_kept"]["words"] >= 0.8
