"""What a wheel holds: pyproject.toml lists every package of the source tree, and the recipes, written in
the repository's top-level recipes/ folder, are mapped into the package so that `--recipe NAME` finds them
from any install (tools/wheel_smoke.sh converts with one from a built wheel)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

REPO = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_of_the_source_tree_is_listed():
    folders = [REPO / "comera_convert", *(REPO / "comera_convert").rglob("*")]
    found = {".".join(path.relative_to(REPO).parts) for path in folders
             if path.is_dir() and path.name != "__pycache__"}
    mapped = set(SETUPTOOLS["package-dir"])
    assert set(SETUPTOOLS["packages"]) - mapped == found


def test_the_recipes_folder_is_the_packaged_recipes_source():
    from comera_convert.recipes import INSTALLED, packaged_recipes, recipes_folder

    assert SETUPTOOLS["package-dir"]["comera_convert.recipes.packaged"] == "recipes"
    assert SETUPTOOLS["package-data"]["comera_convert.recipes.packaged"] == ["*.yaml"]
    if INSTALLED.is_dir():
        pytest.skip("comera_convert is installed from a wheel here: its recipes are the wheel's copy")
    assert recipes_folder() == REPO / "recipes"
    assert set(packaged_recipes()) == {path.stem for path in (REPO / "recipes").glob("*.yaml")} != set()
