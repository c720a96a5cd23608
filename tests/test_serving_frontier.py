"""The serving frontier: several checkpoints of one source timed side by side, each method's speed a ratio of
its own rounds' timings against dense and against the fastest route that needs no comera, and the plot."""

import json
import statistics

import pytest
from click.testing import CliRunner

import comera_convert
from comera_convert.bench import serving
from comera_convert.bench.serving_plot import plot_serving
from comera_convert.cli import main

from .tiny_models import build, serving_checkpoint, word_tokenizer


def test_each_ratio_is_taken_within_its_round_and_its_error_over_the_rounds():
    rounds = {"dense": [2.0, 4.0, 3.0], "fast": [1.0, 1.0, 1.0], "slow": [4.0, 8.0, 6.0]}
    ratios = serving.round_ratios(rounds, "dense")
    assert ratios["dense"] == (1.0, 0.0)
    assert ratios["fast"][0] == 3.0  # the rounds' ratios 2, 4, 3: their median, not a ratio of medians
    assert ratios["fast"][1] == pytest.approx(statistics.stdev([2, 4, 3]) / 3 ** 0.5)
    assert ratios["slow"] == (0.5, 0.0)  # twice as slow in every round, however the machine drifted


def test_the_routes_with_no_comera_are_the_dense_graphs_and_the_peers():
    names = ["dense", "dense, int8 dynamic (torch)", "comera float32", "dense, OpenVINO",
             "dense, OpenVINO int8 (NNCF, as sentence-transformers quantizes)",
             "dense, ONNX Runtime int8 (sentence-transformers' quantization)", "comera, OpenVINO int8 [a]",
             "peer: openvino/openvino_model_qint8_quantized.xml"]
    assert serving.zero_effort(names) == names[3:6] + names[7:]


def two_checkpoints(tmp_path):
    checkpoint, dense, pairs = serving_checkpoint(tmp_path)
    model = build("bert")
    comera_convert.convert(model, ratio=4)
    model.save_pretrained(tmp_path / "tt4")
    word_tokenizer().save_pretrained(tmp_path / "tt4")
    return [checkpoint, tmp_path / "tt4"], dense, pairs


def test_checkpoints_side_by_side_are_named_and_their_speeds_are_ratios_of_the_timed_rounds(tmp_path, monkeypatch):
    checkpoints, dense, pairs = two_checkpoints(tmp_path)
    calls = []  # each call's rounds, which the rows must be computed from

    def timed(models, batches, repeats):  # dense runs slower in the second call: the machine drifted
        calls.append({name: [(1 + len(calls)) * (0.5 + 0.1 * index) + 0.05 * r for r in range(repeats)]
                      for index, name in enumerate(models)})
        return calls[-1]

    monkeypatch.setattr(serving, "timed_rounds", timed)
    result = CliRunner().invoke(main, ["bench", "inference", "--checkpoint", str(checkpoints[0]), "--checkpoint",
                                       str(checkpoints[1]), "--reference", str(dense), "--pairs", str(pairs),
                                       "--texts", "12", "--repeats", "3", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads(result.output)["rows"]}
    assert list(rows) == ["dense", "dense, int8 dynamic (torch)", "comera float32 [tt]", "comera int8 compute [tt]",
                          "comera float32 [tt4]", "comera int8 compute [tt4]"]
    # one checkpoint's methods loaded and timed at a time, beside dense (what its speeds are ratios against)
    assert [list(call) for call in calls] == [list(rows)[:4], ["dense", *list(rows)[4:]]]
    assert rows["comera float32 [tt4]"]["checkpoint"] == "tt4" and "checkpoint" not in rows["dense"]
    for name, row in rows.items():
        timed_with = [call for call in calls if name in call]  # dense: both calls' rounds
        mine, base = ([s for call in timed_with for s in call[key]] for key in (name, "dense"))
        assert row["speed_vs_dense"] == round(statistics.median([d / m for d, m in zip(base, mine)]), 2)
        assert row["sentences_per_s"] == round(12 / statistics.median(mine), 1)
        assert row["worst_kept"] == min(row["recall_kept"].values())
    # no route without comera among the PyTorch methods: nothing to set the peer by
    assert all("speed_vs_peer" not in row for row in rows.values())
    # the two conversions differ, and each is scored on its own
    assert rows["comera float32 [tt]"]["recall_kept"] != rows["comera float32 [tt4]"]["recall_kept"] or \
        rows["comera float32 [tt]"]["sentences_per_s"] != rows["comera float32 [tt4]"]["sentences_per_s"]


def test_checkpoints_of_different_sources_are_refused_in_one_line(tmp_path):
    checkpoint, _, pairs = serving_checkpoint(tmp_path)
    for name in ("one", "other"):  # two dense models, a conversion of each that records its source
        model = build("bert")
        model.save_pretrained(tmp_path / f"{name}-dense")
        comera_convert.convert(model, ratio=3, source=str(tmp_path / f"{name}-dense"))
        model.save_pretrained(tmp_path / name)
        word_tokenizer().save_pretrained(tmp_path / name)
    result = CliRunner().invoke(main, ["bench", "inference", "--checkpoint", str(tmp_path / "one"), "--checkpoint",
                                       str(tmp_path / "other"), "--pairs", str(pairs), "--texts", "12"])
    assert result.exit_code == 1
    assert "--checkpoint: the checkpoints measured side by side share one dense source" in result.output
    refused = CliRunner().invoke(main, ["bench", "inference", "--checkpoint", str(checkpoint), "--plot", "x.png"])
    assert refused.exit_code == 1 and "--plot draws the serving case, and the cases are inference" in refused.output


def test_the_plot_puts_every_route_and_checkpoint_beside_the_fastest_route(tmp_path):
    peer = "dense, OpenVINO int8 (NNCF, as sentence-transformers quantizes)"
    rows = [{"method": name, "shape": "minilm, 256 texts, batch 32", "speed_vs_peer": speed,
             "speed_vs_peer_error": 0.02, "worst_kept": kept, "worst_kept_error": 0.02, "peer": peer,
             **({"checkpoint": "r4"} if name.startswith("comera") else {})}
            for name, speed, kept in [("dense", 0.4, 1.0), ("dense, OpenVINO", 0.7, 1.0), (peer, 1.0, 0.99),
                                      ("comera, OpenVINO int8 [r4]", 1.4, 0.95),
                                      ("comera, ONNX Runtime int8 [r4]", 1.1, 0.96)]]
    file = plot_serving(rows, tmp_path / "images" / "frontier.png", "AMD EPYC, 2 threads")  # its folder made
    assert file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(file.parent.glob(".*tmp*"))
