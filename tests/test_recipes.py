from pathlib import Path

import pytest

from comera_convert.conversion import ConvertOptions
from comera_convert.errors import ConfigError
from comera_convert.recipes import convert_options, load_recipe, train_options
from comera_convert.training import TrainOptions

ALL_RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
RECIPES = [r for r in ALL_RECIPES if not r.name.startswith("train-")]  # conversion recipes


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=[r.stem for r in ALL_RECIPES])
def test_every_recipe_loads_and_documents_its_keys(recipe):
    if recipe.name.startswith("train-"):
        assert isinstance(train_options(recipe, {}), TrainOptions)
    else:
        assert isinstance(convert_options(recipe, {}), ConvertOptions)
    text = recipe.read_text()
    for key in load_recipe(recipe):
        line = next(i for i, l in enumerate(text.splitlines()) if l.startswith(f"{key}:"))
        above = text.splitlines()[:line]
        assert any(l.startswith("#") for l in above[-3:]), f"{key} in {recipe.name} has no comment above it"


def test_command_line_overrides_the_recipe():
    recipe = RECIPES[0]
    assert convert_options(recipe, {"ratio": 8.0, "layout": None}).ratio == 8.0
    assert convert_options(recipe, {"rank": 12}).rank == 12


def test_bad_recipes(tmp_path):
    (tmp_path / "typo.yaml").write_text("ratoi: 4\n")
    with pytest.raises(ConfigError, match="unknown key.*ratoi.*expected some of"):
        convert_options(tmp_path / "typo.yaml", {})
    (tmp_path / "list.yaml").write_text("- 4\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        convert_options(tmp_path / "list.yaml", {})
    with pytest.raises(ConfigError, match="does not exist"):
        convert_options(tmp_path / "missing.yaml", {})
