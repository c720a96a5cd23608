"""`comera bench --quick`: the benchmark runs end to end in CI-sized form. Timings are printed,
never asserted (shared machines are noisy); the rows' structure and the measured facts that do
not depend on speed are."""

import json

import pytest
import torch
from click.testing import CliRunner

from comera_convert.cli import main


# The cases measured in this process; train-step runs each variant in a fresh process (nine of them),
# so its whole run is a slow test of its own (``train_step_rows``).
IN_PROCESS_CASES = ["layer", "embedding", "convert", "inference"]


def quick_run(tmp_path_factory, *cases):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    result = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["bench", *cases, "--quick", "--json", str(path)])
    assert result.exit_code == 0, result.output
    print(result.output)
    return {**json.loads(path.read_text()), "output": result.output}


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory):
    return quick_run(tmp_path_factory, *IN_PROCESS_CASES)


@pytest.fixture(scope="module")
def train_step_rows(tmp_path_factory):
    return quick_run(tmp_path_factory, "train-step")


def test_every_case_reports_rows_that_name_device_dtype_and_shape(quick_rows):
    assert quick_rows["quick"] and quick_rows["machine"]
    # Into a log (not a terminal) each step is a line as it starts: a run cut short shows how far it got.
    assert "bench: layer\n" in quick_rows["output"]
    cases = {row["case"] for row in quick_rows["rows"]}
    assert cases == set(IN_PROCESS_CASES)
    for row in quick_rows["rows"]:
        assert row["device"] == "cpu" and row["dtype"] and row["shape"]


def test_layer_rows_carry_the_flop_model(quick_rows):
    layer = [r for r in quick_rows["rows"] if r["case"] == "layer" and r["method"].startswith("TTLinear")]
    assert layer and all(r["ranks"] and r["params_ratio"] > 0 and r["flop_ratio"] > 0 for r in layer)
    assert all(r["params_ratio"] > 1 for r in layer if "r30" in r["method"])  # rank 30 always compresses
    for r in layer:  # each figure is rounded to 2 decimals: allow exactly that rounding's effect
        a, b = r["speedup"], r["flop_ratio"]
        bound = 0.005 + 0.005 / b + a * 0.005 / b ** 2 + 1e-9
        assert abs(r["speedup_per_flop_ratio"] - a / b) <= bound, r


@pytest.mark.slow
def test_train_step_compares_against_dense_and_galore(train_step_rows):
    assert "bench: train-step, batch 2: dense AdamW (1/9)\n" in train_step_rows["output"]
    measured = train_step_rows["rows"]
    assert {row["case"] for row in measured} == {"train-step"}
    rows = {r["method"]: r for r in measured}
    assert len(rows) == len(measured) and {r["shape"] for r in measured} == {"tiny bert-base, batch 2 x seq 32"}
    plain = {"dense AdamW", "GaLore AdamW r128", "TT comera r30", "TT r30, tt embedding", "TT --ratio 4"}
    checkpointed = {"dense AdamW + checkpointing", "GaLore AdamW r128 + checkpointing", "TT comera r30 + checkpointing",
                    "TT r30, tt embedding + checkpointing"}
    assert set(rows) == plain | checkpointed
    assert rows["dense AdamW"]["speed_vs_dense"] == 1.0
    # Checkpointed variants are compared with the checkpointed baselines: each baseline with itself.
    dense, galore = rows["dense AdamW + checkpointing"], rows["GaLore AdamW r128 + checkpointing"]
    assert dense["speed_vs_dense"] == dense["memory_vs_dense"] == 1.0
    assert galore["speed_vs_galore"] == galore["memory_vs_galore"] == 1.0
    for row in rows.values():
        assert "error" not in row, row
        assert row["peak_mb"] > 0
    assert rows["TT --ratio 4"]["params"] < rows["dense AdamW"]["params"] / 3


def test_bench_help_and_bad_device():
    runner = CliRunner()
    assert runner.invoke(main, ["bench", "--help"]).exit_code == 0
    import torch

    if not torch.cuda.is_available():
        result = runner.invoke(main, ["bench", "layer", "--device", "cuda", "--quick"])
        assert result.exit_code == 1 and "no CUDA device" in result.output


def test_chosen_variants_bring_their_dense_baselines():
    from comera_convert.bench.models import chosen_variants, train_step_variants
    from comera_convert.errors import ConfigError

    assert chosen_variants("cpu") == train_step_variants("cpu")
    assert chosen_variants("cpu", ["TT --ratio 4"]) == ["dense AdamW", "TT --ratio 4"]
    assert chosen_variants("cpu", ["TT comera r30 + checkpointing"]) == [
        "dense AdamW", "dense AdamW + checkpointing", "TT comera r30 + checkpointing"]
    assert chosen_variants("cuda", ["TT --ratio 4 + CUDA graph"]) == [
        "dense AdamW", "dense AdamW + CUDA graph", "TT --ratio 4 + CUDA graph"]
    with pytest.raises(ConfigError,
                       match=r"among 'dense AdamW', .*'TT r30, tt embedding'.* \(got 'TT --ratio 4 \+ CUDA graph'\)"):
        chosen_variants("cpu", ["TT --ratio 4 + CUDA graph"])  # graphs are CUDA-only
    # Compiled variants are graphed too, and are compared with dense compiled and graphed.
    assert chosen_variants("cuda", ["TT --ratio 8, ranks of 8 + compile + CUDA graph"]) == [
        "dense AdamW", "dense AdamW + compile + CUDA graph", "TT --ratio 8, ranks of 8 + compile + CUDA graph"]
    with pytest.raises(ConfigError, match=r"\(got 'TT --ratio 8, ranks of 8 \+ compile \+ CUDA graph'\)"):
        chosen_variants("cpu", ["TT --ratio 8, ranks of 8 + compile + CUDA graph"])


def test_a_variant_cut_to_a_target_steps_at_the_shapes_a_target_ratio_run_ends_with(tmp_path):
    """`TT --ratio 4 cut to 8x`: the --ratio 4 checkpoint loaded, its gates closed to 8x by the
    budget and the closed ranks cut out of the cores, as `comera train --target-ratio 8` does; the
    cut model still trains, and its step runs the smaller cores."""
    from comera_convert.bench.models import load_variant, save_variants, training_step
    from comera_convert.layers.base import TTModule

    names = ["TT --ratio 4, ranks of 8", "TT --ratio 4 cut to 8x, ranks of 8"]
    paths = save_variants(tmp_path, True, names, "llama-1.1b")
    (whole, _), (cut, optimizer) = (load_variant(name, paths[name], "cpu") for name in names)
    dense_params = cut.config.quantization_config.dense_params
    params = sum(p.numel() for p in cut.parameters())
    assert dense_params / params >= 8.0 > dense_params / sum(p.numel() for p in whole.parameters())
    layers = [(a.bond_dims, b.bond_dims) for a, b in zip(whole.modules(), cut.modules())
              if isinstance(a, TTModule) and isinstance(b, TTModule)]
    assert layers and all(small <= big for big, small in layers) and any(small < big for big, small in layers)
    assert all(r % 8 == 0 for _, small in layers for r in small)  # cut in whole multiples of 8
    assert all(m.ranks == m.bond_dims for m in cut.modules() if isinstance(m, TTModule))  # cut, not masked
    before = {name: p.detach().clone() for name, p in cut.named_parameters()}
    training_step(cut, optimizer, torch.randint(0, cut.config.vocab_size, (2, 16)))()
    assert any(not torch.equal(before[name], p) for name, p in cut.named_parameters())
    assert all(torch.isfinite(p).all() for p in cut.parameters())


def test_bench_variant_option(tmp_path):
    runner = CliRunner(env={"COLUMNS": "200"})
    path = tmp_path / "bench.json"
    result = runner.invoke(main, ["bench", "train-step", "--quick", "--variant", "dense AdamW", "--json", str(path)])
    assert result.exit_code == 0, result.output
    rows = json.loads(path.read_text())["rows"]
    assert [(r["method"], r["shape"]) for r in rows] == [("dense AdamW", "tiny bert-base, batch 2 x seq 32")]
    assert all("error" not in r and r["peak_mb"] > 0 for r in rows)
    # Mistakes fail before anything runs, in one line.
    result = runner.invoke(main, ["bench", "--quick", "--variant", "TT r40"])
    assert result.exit_code == 1 and "(got 'TT r40')" in result.output and "bench:" not in result.output
    result = runner.invoke(main, ["bench", "layer", "--quick", "--variant", "TT --ratio 4"])
    assert result.exit_code == 1 and "--variant chooses train-step variants, and the cases are layer" in result.output


@pytest.mark.slow
def test_bench_train_step_of_a_llama(tmp_path):
    """`--model llama-1.1b` times a causal LM's step (TinyLlama's shape, tiny under --quick): dense and its
    --ratio 4 conversion, each loaded as the architecture its checkpoint records."""
    runner = CliRunner(env={"COLUMNS": "200"})
    path = tmp_path / "bench.json"
    result = runner.invoke(main, ["bench", "train-step", "--quick", "--model", "llama-1.1b",
                                  "--variant", "TT --ratio 4", "--json", str(path)])
    assert result.exit_code == 0, result.output
    rows = {r["method"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"dense AdamW", "TT --ratio 4"}
    assert all("error" not in r and r["shape"] == "tiny llama-1.1b, batch 2 x seq 32" for r in rows.values()), rows
    from comera_convert.bench.models import LLAMA_QUICK, training_model

    dense = training_model("llama-1.1b", quick=True)
    assert type(dense).__name__ == "LlamaForCausalLM" and dense.config.hidden_size == LLAMA_QUICK["hidden_size"]
    assert rows["dense AdamW"]["params"] == sum(p.numel() for p in dense.parameters())
    assert rows["TT --ratio 4"]["params"] < rows["dense AdamW"]["params"] / 3
    result = runner.invoke(main, ["bench", "layer", "--quick", "--model", "llama-1.1b"])
    assert result.exit_code == 1 and "--model chooses the train-step model, and the cases are layer" in result.output


def test_bfloat16_training_step_keeps_float32_weights_under_autocast():
    """`comera bench --dtype bfloat16` trains as `comera train --bf16` does: the layers compute in
    bfloat16, the weights and their update stay float32."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    import comera_convert
    from comera_convert.bench.models import training_step, training_dtype_name

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, vocab_size=100))
    comera_convert.convert(model, rank=4)
    outputs = []
    model.bert.encoder.layer[0].intermediate.dense.register_forward_hook(lambda m, a, out: outputs.append(out.dtype))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    training_step(model, optimizer, torch.randint(0, 100, (2, 8)), torch.bfloat16)()
    assert outputs == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(not torch.equal(old, p) for old, p in zip(before, model.parameters())) > len(before) / 2
    assert training_dtype_name(torch.bfloat16) == "bfloat16 autocast"
    assert training_dtype_name(torch.float32) == "float32"
