"""Serving forms: a compressed model as plain linears and lookups computes what the compressed model computes,
in every form a pair can take; the forms' timing picks among candidates it measured and says why."""

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer

import comera_convert
from comera_convert.conversion.calibration import collect
from comera_convert.conversion.storage import integer_format, train_on_the_grid
from comera_convert.conversion.targets import find_candidates
from comera_convert.errors import ConfigError
from comera_convert.hf.form_timing import FormChoice, _chosen, candidates, layer_groups, plan_forms
from comera_convert.layers import CodebookEmbedding, PrunedLinear, TTEmbedding, TTLinear
from comera_convert.layers.serving_forms import CodebookLookup, FactorPair, HalvesLookup, factor_pairs, serving_copy

from .tiny_models import build, inputs, outputs


def converted(**options):
    """A tiny BERT converted 3x; ``ffn="prune"`` calibrated on random token ids, as pruning needs."""
    model = build("bert")
    if options.get("ffn") == "prune":
        batches = [torch.randint(5, 500, (8, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
        options["calibration"] = collect(model, find_candidates(model)[0], batches, source="test")
        options["reconstruct_steps"] = 0
    comera_convert.convert(model, ratio=3, **options)
    return model.eval()


@pytest.fixture(scope="module")
def pruned():
    """A tiny BERT with every kind of compressed module: codebook words, TT positions, pairs, pruned pairs."""
    return converted(ffn="prune")


@pytest.mark.parametrize("form", ["pair", "merged"])
def test_every_form_computes_what_the_compressed_model_computes(pruned, form):
    kinds = {type(m) for m in pruned.modules()}
    assert {CodebookEmbedding, TTEmbedding, TTLinear, PrunedLinear} <= kinds  # every kind is covered
    served = serving_copy(pruned, default=form)
    batch = inputs(seed=3)
    assert torch.allclose(outputs(served, batch), outputs(pruned, batch), atol=1e-5)
    served_kinds = {type(m) for m in served.modules()}
    assert not {CodebookEmbedding, TTEmbedding, TTLinear, PrunedLinear} & served_kinds
    assert {CodebookLookup, HalvesLookup} <= served_kinds
    assert (FactorPair in served_kinds) == (form == "pair")
    assert not any(p.requires_grad for p in served.parameters())
    assert isinstance(pruned.encoder.layer[0].attention.self.query, TTLinear)  # the source is left as it was


def test_each_pair_takes_its_own_form_and_a_pair_is_balanced_through_its_bond(pruned):
    name = "encoder.layer.0.attention.self.query"
    served = serving_copy(pruned, {name: "merged"})
    assert type(served.get_submodule(name)) is nn.Linear
    other = served.get_submodule("encoder.layer.0.attention.self.key")
    assert isinstance(other, FactorPair) and other.rank == pruned.get_submodule(
        "encoder.layer.0.attention.self.key").ranks[0]
    # the left factor's rows (one per bond index) of unit norm: the bond's activations share one range
    norms = other.first.weight.norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)
    with pytest.raises(ValueError, match=r"expected a form in \('pair', 'merged'\) for default \(got 'fused'\)"):
        serving_copy(pruned, default="fused")


def test_integer_storage_serves_the_rounded_weights():
    model = converted(ffn="prune")
    batch = inputs(seed=5)
    floats = outputs(model, batch)
    train_on_the_grid(model, integer_format("int4"))  # as an int4 checkpoint loads: each layer on its grid
    rounded = outputs(model, batch)
    assert not torch.allclose(rounded, floats, atol=1e-3)
    for form in ("pair", "merged"):
        assert torch.allclose(outputs(serving_copy(model, default=form), batch), rounded, atol=1e-5)


def test_the_layers_are_grouped_by_shape_and_a_fixed_request_times_nothing(pruned):
    groups = layer_groups(pruned)
    pairs = factor_pairs(pruned)
    assert sorted(name for key, names in groups.items() if len(key) == 3 for name in names) == sorted(pairs)
    assert {name for key, names in groups.items() if len(key) == 2 for name in names} >= {
        name for name, m in pruned.named_modules() if isinstance(m, PrunedLinear)}
    plan = plan_forms(pruned, "openvino", True, forms="merged")
    assert all(not group.milliseconds for group in plan.groups)
    assert set(plan.forms().values()) == {"merged"} and set(plan.forms()) == set(pairs)
    assert plan.float_layers() == []
    assert candidates([64, 10, 64], True) == ["pair/int8", "pair/float", "merged/int8", "merged/float"]
    assert candidates([64, 128], False) == ["linear/float"]


def test_requests_the_timing_cannot_serve_are_refused(pruned):
    with pytest.raises(ConfigError, match=r"--runtime: expected one of openvino, onnx \(got 'tflite'\)"):
        plan_forms(pruned, "tflite", True)
    with pytest.raises(ConfigError, match=r"--forms: expected one of auto, pair, merged \(got 'fused'\)"):
        plan_forms(pruned, "openvino", True, forms="fused")


def test_the_fastest_candidate_wins_unless_the_noise_is_wider_than_its_lead():
    quiet = {"pair/int8": [0.010, 0.0101, 0.0102], "merged/int8": [0.006, 0.0061, 0.0062],
             "pair/float": [0.02, 0.02, 0.02], "merged/float": [0.03, 0.03, 0.03]}
    chosen = _chosen(["a"], [64, 32, 64], quiet, int8=True)
    assert chosen.chosen == "merged/int8" and not chosen.noisy
    assert chosen.milliseconds["merged/int8"] == pytest.approx(6.1) and chosen.form == "merged"
    noisy = {**quiet, "merged/int8": [0.002, 0.0095, 0.03]}  # median ahead, spread far wider than the lead
    kept = _chosen(["a"], [64, 32, 64], noisy, int8=True)
    assert kept.chosen == "pair/int8" and kept.noisy
    assert isinstance(kept, FormChoice) and kept.precision == "int8"


@pytest.mark.parametrize("runtime", ["openvino", "onnx"])
def test_timing_on_the_machine_measures_every_candidate_of_each_group(runtime):
    pytest.importorskip("openvino" if runtime == "openvino" else "onnxruntime")
    if runtime == "openvino":
        pytest.importorskip("nncf")
    model = converted()
    plan = plan_forms(model, runtime, True, shape=(2, 8), rounds=2)
    timed = [group for group in plan.groups if group.milliseconds]
    assert timed and all(set(g.milliseconds) == set(candidates(g.shape, True)) for g in timed)
    assert all(g.chosen in g.milliseconds and g.milliseconds[g.chosen] > 0 for g in timed)
    assert sorted(n for g in plan.groups for n in g.layers) == sorted(n for names in layer_groups(model).values()
                                                                   for n in names)
    assert any(line.startswith("64x10x64") for line in plan.summary())


def test_the_export_writes_the_forms_it_served_and_each_graph_holds_them(tmp_path):
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    import json

    import openvino

    from comera_convert.hf.openvino_export import write_openvino_graphs

    from .test_onnx import sentence_folder

    model, path = sentence_folder(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    pairs = sorted(factor_pairs(model))
    for form in ("pair", "merged"):
        folder = tmp_path / form
        folder.mkdir()
        result = write_openvino_graphs(model, tokenizer, folder, quantize=None, forms=form)
        written = json.loads((folder / "serving_forms.json").read_text())
        assert written == result.forms and list(written["graphs"]) == ["openvino_model.xml"]
        plan = written["graphs"]["openvino_model.xml"]
        assert plan["runtime"] == "openvino" and not plan["int8"] and written["cpu"]
        assert sorted(name for g in plan["groups"] if len(g["shape"]) == 3 for name in g["layers"]) == pairs
        graph = openvino.Core().read_model(folder / "openvino_model.xml")
        names = [op.get_friendly_name() for op in graph.get_ops() if op.get_type_name() == "MatMul"]
        in_pairs = [name for name in names if f".{pairs[0]}.first/" in name or f".{pairs[0]}.second/" in name]
        assert len(in_pairs) == (2 if form == "pair" else 0)
        assert result.max_difference < 1e-4  # each form computes what PyTorch does


def test_a_layer_left_float_is_not_quantized_in_either_runtime(tmp_path):
    """The int8 graphs keep the products of a layer the plan leaves in float, and quantize the others."""
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    import onnx

    from comera_convert.hf.onnx_export import write_graphs
    from comera_convert.hf.openvino_export import frontend_graph, quantize_static
    from comera_convert.hf.onnx_int8 import layer_nodes, quantize_int8

    from .test_onnx import sentence_folder

    model, path = sentence_folder(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    left, quantized = "encoder.layer.0.attention.self.query", "encoder.layer.0.attention.self.key"
    plan = plan_forms(model, "openvino", True, forms="pair")
    graph = quantize_static(frontend_graph(model, plan, tokenizer(["w1 w2 w3"], return_tensors="pt").data),
                            tokenizer, 16, float_layers=[left])

    def fed_by_quantizer(layer):  # each product of the layer: is its weight's input a FakeQuantize?
        found = [op for op in graph.get_ops() if op.get_type_name() == "MatMul" and f".{layer}." in
                 op.get_friendly_name()]
        return [any(v.get_node().get_type_name() in ("FakeQuantize", "FakeConvert") or
                    any(w.get_node().get_type_name() == "FakeQuantize" for w in v.get_node().input_values())
                    for v in op.input_values()) for op in found]

    assert fed_by_quantizer(left) == [False, False] and fed_by_quantizer(quantized) == [True, True]
    onnx_file = write_graphs(model, tokenizer, tmp_path, forms="pair").graphs[0]
    assert len(layer_nodes(onnx_file, [left])) == 2  # the pair's two products
    int8 = tmp_path / "int8.onnx"
    quantize_int8(onnx_file, int8, "avx512_vnni", float_layers=[left])
    kept = {node.name for node in onnx.load(str(int8)).graph.node if node.op_type == "MatMul"}
    assert set(layer_nodes(onnx_file, [left])) <= kept
    assert not set(layer_nodes(onnx_file, [quantized])) & kept
