"""Sharded compressed checkpoints (`--max-shard-size`): written with an index, loaded by all three
ways, counted by `comera report`, and refused in one line when a shard is missing or cut short."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers as tf
from click.testing import CliRunner

import comera_convert
from comera_convert.cli import main
from comera_convert.errors import ConfigError, ModelLoadError
from comera_convert.hf.saving import shard_bytes

from .tiny_models import build, inputs, outputs


def run(*args):
    return CliRunner(env={"COLUMNS": "200"}).invoke(main, [str(a) for a in args])


def sharded_checkpoint(folder, tied: bool):
    """A Llama-shaped model with grouped-query attention (its head tied to its embedding or not),
    converted by the CLI into 100 KB shards: (dense folder, compressed folder)."""
    model = build("llama-clm")
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    dense = folder / "dense"
    model.save_pretrained(dense)
    out = folder / "tt"
    result = run("convert", dense, "--ratio", "2", "--max-shard-size", "100KB", "--out", out)
    assert result.exit_code == 0, result.output
    return dense, out


@pytest.fixture(params=[False, True], ids=["untied-head", "tied-head"])
def sharded(request, tmp_path):
    return sharded_checkpoint(tmp_path, request.param)


def test_shards_and_index_are_written_and_load_three_ways(sharded, tmp_path):
    dense, out = sharded
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert all(f.stat().st_size <= 100_000 * 1.5 for f in shards)  # one tensor may overflow a shard
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in shards}

    reference = comera_convert.from_pretrained(out).eval()
    auto = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(outputs(auto), outputs(reference))
    dense_model = tf.AutoModelForCausalLM.from_pretrained(dense).eval()
    assert not torch.equal(outputs(reference), outputs(dense_model))  # it is the compressed model
    report = json.loads(run("report", out, "--json").output)
    assert report["params"] == report["report"]["params_after"]  # every shard counted
    assert report["disk_bytes"] == sum(f.stat().st_size for f in shards)


def test_sharded_checkpoints_load_with_remote_code_in_a_fresh_process(tmp_path):
    """The third way (trust_remote_code, no import of ours), for both heads in one fresh process."""
    script = textwrap.dedent("""
        import sys, torch
        from transformers import AutoModelForCausalLM
        ids = torch.load(sys.argv[1])
        for path in sys.argv[2:]:
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
            torch.save(model(input_ids=ids).logits, path + ".logits.pt")
    """)
    outs = [sharded_checkpoint(tmp_path / name, tied)[1] for name, tied in (("untied", False), ("tied", True))]
    torch.save(inputs()["input_ids"], tmp_path / "ids.pt")
    fresh = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ids.pt"), *map(str, outs)],
                           capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    for out in outs:
        reference = comera_convert.from_pretrained(out).eval()
        assert torch.equal(torch.load(f"{out}.logits.pt"), outputs(reference)), out.parent.name


def test_decompress_shards_too(sharded, tmp_path):
    _, out = sharded
    assert run("decompress", out, "--out", tmp_path / "back", "--max-shard-size", "200KB").exit_code == 0
    assert len(list((tmp_path / "back").glob("model-*.safetensors"))) > 1
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert torch.allclose(outputs(plain), outputs(comera_convert.from_pretrained(out).eval()), atol=1e-5)


def test_a_missing_or_truncated_shard_is_one_line(sharded):
    _, out = sharded
    shards = sorted(out.glob("model-*.safetensors"))
    shards[-1].write_bytes(shards[-1].read_bytes()[:-64])  # cut short
    with pytest.raises(ModelLoadError, match="truncated"):
        comera_convert.from_pretrained(out)
    shards[-1].unlink()  # gone, though the index names it
    result = run("eval", out)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{shards[-1].name} is missing: the checkpoint is incomplete" in result.output.replace("\n", " ")


@pytest.mark.parametrize("size, expected", [("100KB", 100_000), ("2GB", 2 * 10 ** 9), ("10MiB", 10 * 2 ** 20),
                                            (4096, 4096)])
def test_shard_sizes_parse(size, expected):
    assert shard_bytes(size) == expected


@pytest.mark.parametrize("size", ["lots", "0MB", "5XB", "-1GB"])
def test_a_size_that_cannot_work_is_refused_before_converting(size, tmp_path):
    with pytest.raises(ConfigError, match="--max-shard-size as a positive size"):
        shard_bytes(size)
    dense = tmp_path / "dense"
    build("bert").save_pretrained(dense)
    result = run("convert", dense, "--ratio", "2", "--max-shard-size", size, "--out", tmp_path / "o")
    assert result.exit_code == 1 and "--max-shard-size as a positive size" in result.output
    assert not (tmp_path / "o").exists()
