"""int8 compute for CPU inference: Int8Linear against the float layers it replaces, the model-level
swap, its refusals, and `comera bench inference --checkpoint` on a tiny checkpoint."""

import json
import re

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import comera_convert
from comera_convert.cli import main
from comera_convert.bench import serving
from comera_convert.errors import ConfigError
from comera_convert.integer import compute
from comera_convert.layers import Int8Linear, TTLinear, use_int8_compute

from .conftest import rel_err
from .tiny_models import build, inputs, serving_checkpoint, word_tokenizer

# int8 rounding of the weights and of each GEMM's input: a few percent of the output's norm.
INT8_TOLERANCE = 0.05


@pytest.mark.parametrize("shape", [(64, 48), (37, 5), (7, 1)])  # odd widths: the kernels tile any width
def test_int8_linear_matches_the_dense_layer(shape):
    torch.manual_seed(0)
    linear = nn.Linear(*shape)
    x = torch.randn(3, 9, shape[0])
    with torch.no_grad():
        assert rel_err(Int8Linear.from_linear(linear)(x), linear(x)) < INT8_TOLERANCE


def test_int8_pair_matches_the_tt_layer_through_its_bond():
    torch.manual_seed(0)
    layer = TTLinear.from_linear(nn.Linear(96, 80), rank=24, d=1).eval()
    with torch.no_grad():
        layer.gates[0][5:9] = 0.0  # closed entries: all-zero rows of a factor round without dividing by zero
        x = torch.randn(4, 7, 96)
        int8 = Int8Linear.from_tt(layer)
        assert rel_err(int8(x), layer(x)) < INT8_TOLERANCE
    assert len(int8.packed) == 2 and "rank 24" in repr(int8)


def test_balancing_the_bond_keeps_the_product_and_evens_its_columns():
    left, right = torch.randn(32, 8) * torch.logspace(-2, 2, 8), torch.randn(8, 16)
    balanced_left, balanced_right = compute.balance_bond(left, right)
    assert torch.allclose(balanced_left @ balanced_right, left @ right, rtol=1e-4, atol=1e-4)
    assert torch.allclose(balanced_left.norm(dim=0), torch.ones(8))


def test_use_int8_compute_swaps_a_converted_model_and_keeps_its_outputs():
    model = build("bert")
    comera_convert.convert(model, ratio=3)
    batch = inputs()
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
        tt_layers = sum(isinstance(m, TTLinear) for m in model.modules())
        dense_layers = sum(isinstance(m, nn.Linear) for m in model.modules())
        swap = use_int8_compute(model)
        got = model(**batch).last_hidden_state
    assert (swap.low_rank, swap.dense) == (tt_layers, dense_layers) and swap.low_rank > 0
    assert not any(isinstance(m, (TTLinear, nn.Linear)) for m in model.modules())
    assert rel_err(got, expected) < 2 * INT8_TOLERANCE  # rounding errors of every layer add up


def test_a_swapped_model_is_not_saved_without_its_weights(tmp_path):
    model = build("bert")
    comera_convert.convert(model, ratio=3)
    use_int8_compute(model)
    with pytest.raises(ConfigError, match=r"encoder\.layer\.0\..* computes in int8 and is not saved: save the float"):
        model.save_pretrained(tmp_path / "int8")
    assert not (tmp_path / "int8" / "model.safetensors").exists()


def test_ttm_layers_stay_float_and_are_named():
    model = nn.Sequential(TTLinear(64, 64, rank=8, layout="ttm", d=2), nn.Linear(64, 8))
    swap = use_int8_compute(model, dense_layers=False)
    assert swap.kept_float == {"0": "ttm layout"} and (swap.low_rank, swap.dense) == (0, 0)
    assert isinstance(model[0], TTLinear) and isinstance(model[1], nn.Linear)


def test_refusals_say_what_was_expected():
    layer = Int8Linear.from_linear(nn.Linear(8, 4))
    with pytest.raises(ConfigError, match="float32 input.*bfloat16"):
        layer(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="int8 compute is for inference"):
        layer(torch.randn(2, 8, requires_grad=True))
    with pytest.raises(ValueError, match="last dimension 8.*\\(2, 5\\)"):
        layer(torch.randn(2, 5))
    with pytest.raises(ConfigError, match="a float32 model.*bfloat16"):
        use_int8_compute(nn.Linear(8, 4).to(torch.bfloat16))
    with pytest.raises(ConfigError, match="tt layout.*ttm"):
        Int8Linear.from_tt(TTLinear(64, 64, rank=8, layout="ttm", d=2))


def test_a_torch_without_the_kernels_is_named_in_one_line(monkeypatch):
    monkeypatch.setattr(compute, "supported_engines", lambda: ["onednn"])
    monkeypatch.setattr(torch.backends.quantized, "engine", "onednn")
    with pytest.raises(ConfigError, match=r"int8 GEMM kernels .*got 'engines onednn'"):
        use_int8_compute(nn.Linear(8, 4))
    monkeypatch.setattr(compute, "has_int8_ops", lambda: False)
    with pytest.raises(ConfigError, match=re.escape(f"torch {torch.__version__} does not have")):
        use_int8_compute(nn.Linear(8, 4))


def test_bench_inference_of_a_checkpoint_rows_every_method_with_its_quality(tmp_path):
    checkpoint, dense, pairs = serving_checkpoint(tmp_path)
    result = CliRunner().invoke(main, ["bench", "inference", "--checkpoint", str(checkpoint), "--reference", str(dense),
                                       "--pairs", str(pairs), "--texts", "12", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads(result.output)["rows"]}
    assert list(rows) == ["dense", "dense, int8 dynamic (torch)", "comera float32", "comera int8 compute"]
    assert rows["dense"]["speed_vs_dense"] == 1.0 and rows["dense"]["recall_kept"] == {"words": 1.0}
    assert rows["dense"]["recall_kept_error"] == {"words": 0.0}  # the dense model against itself
    for row in rows.values():
        assert "12 texts" in row["shape"] and set(row["recall_kept"]) == {"words"}
        assert row["recall_kept_error"]["words"] >= 0
        # One round: the speed against dense is the ratio of the two timings, which the speeds are the
        # texts over (each rounded to 0.1 sentence a second).
        assert row["speed_vs_dense"] == pytest.approx(row["sentences_per_s"] / rows["dense"]["sentences_per_s"],
                                                      rel=0.01, abs=0.01)


@pytest.mark.slow  # compiling four models takes a few minutes
def test_bench_inference_compiled_rows_time_the_compiled_models_and_keep_their_quality(tmp_path):
    checkpoint, dense, pairs = serving_checkpoint(tmp_path)
    result = CliRunner().invoke(main, ["bench", "inference", "--checkpoint", str(checkpoint), "--reference", str(dense),
                                       "--pairs", str(pairs), "--texts", "12", "--repeats", "1", "--compile", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads(result.output)["rows"]}
    # The dense rows first, each eager then compiled, then the checkpoint's.
    dense, ours = ["dense", "dense, int8 dynamic (torch)"], ["comera float32", "comera int8 compute"]
    assert list(rows) == [name + suffix for group in (dense, ours) for suffix in ("", ", torch.compile")
                          for name in group]
    assert all(row["sentences_per_s"] > 0 for row in rows.values())
    # A compiled method is scored as its eager source: what makes that right is that the compiled
    # copy computes the same embeddings, checked here on the compressed model, float and int8.
    tokenizer = word_tokenizer()
    batch = tokenizer(["w11 w12 w13", "w14 w15 w16 w17 w18"], padding=True, return_tensors="pt")
    model = comera_convert.from_pretrained(str(checkpoint)).eval()
    for eager_model in (model, serving.int8_compute_copy(model)):
        with torch.inference_mode():
            expected = eager_model(**batch).last_hidden_state
            got = serving.compiled(eager_model)(**batch).last_hidden_state
        assert rel_err(got, expected) < 1e-4


def test_bench_compile_without_a_cpp_compiler_is_refused_in_one_line(tmp_path, monkeypatch):
    checkpoint, dense, pairs = serving_checkpoint(tmp_path)
    monkeypatch.setenv("CXX", "no-such-compiler")
    result = CliRunner().invoke(main, ["bench", "inference", "--checkpoint", str(checkpoint), "--reference", str(dense),
                                       "--pairs", str(pairs), "--texts", "12", "--compile"])
    assert result.exit_code == 1
    assert result.output.strip().endswith("--compile: torch.compile builds CPU kernels with a C++ compiler, and "
                                          "'no-such-compiler' is not on PATH (install g++, or set CXX to one)")


def test_bench_checkpoint_options_refuse_what_does_not_go_together(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "layer", "--checkpoint", str(tmp_path), "--quick"])
    assert result.exit_code == 1
    assert "--checkpoint measures the inference and serving cases, and the cases are layer" in result.output
    result = runner.invoke(main, ["bench", "inference", "--reference", "x", "--quick"])
    assert result.exit_code == 1 and "--batch, --compile and --peer go with --checkpoint" in result.output
    result = runner.invoke(main, ["bench", "inference", "--compile", "--quick"])
    assert result.exit_code == 1 and "--batch, --compile and --peer go with --checkpoint" in result.output


def test_bench_serving_without_a_checkpoint_is_refused_in_one_line():
    result = CliRunner().invoke(main, ["bench", "serving", "--quick"])
    assert result.exit_code == 1
    assert result.output.strip() == "error: the serving case measures a real checkpoint: give --checkpoint PATH"
