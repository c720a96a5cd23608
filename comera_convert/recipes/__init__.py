"""Recipes: YAML files of options (``comera convert --recipe NAME``, ``comera train --recipe NAME``).

Every key is a field of ConvertRequest (``request.py``) or TrainOptions
(``training/options.py``), which say what each means; command-line options override the recipe's.
The recipes live in the repository's top-level ``recipes/`` folder and ship with the package (a wheel
installs them as ``comera_convert/recipes/packaged/``): ``--recipe train-minilm-distill`` names one, as
does any path ending in its file name; any other YAML file is read as given. Each recipe's first
line says what it is for (``comera recipes`` lists them).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..request import ConvertRequest
from ..errors import ConfigError
from ..training.options import TrainOptions

# Where an installed wheel keeps the recipes (pyproject.toml maps the top-level recipes/ folder there), and
# the folder itself, which a checkout or an editable install reads.
INSTALLED = Path(__file__).resolve().parent / "packaged"
CHECKOUT = Path(__file__).resolve().parents[2] / "recipes"


def recipes_folder() -> Path:
    """The folder the packaged recipes are read from: the wheel's copy, else the checkout's ``recipes/``."""
    return INSTALLED if INSTALLED.is_dir() else CHECKOUT


def packaged_recipes() -> dict[str, Path]:
    """The recipes that ship with the package, by name (the file name without ``.yaml``)."""
    return {path.stem: path for path in sorted(recipes_folder().glob("*.yaml"))}


def purpose(path: Path) -> str:
    """A recipe's first line, what it is for, without its comment mark."""
    lines = path.read_text().splitlines()
    return lines[0].lstrip("#").strip() if lines else ""


def resolve_recipe(recipe: str | Path) -> Path:
    """The file ``recipe`` names: a YAML file that exists, else a packaged recipe named by it (its name,
    or a path ending in its file name, such as ``recipes/train-minilm-distill.yaml``)."""
    path = Path(recipe)
    if path.is_file():
        return path
    packaged = packaged_recipes()
    name = path.name.removesuffix(".yaml").removesuffix(".yml")
    if name in packaged and (path.suffix in ("", ".yaml", ".yml")):
        return packaged[name]
    raise ConfigError(f"recipe {recipe} does not exist: expected a YAML file or a packaged recipe "
                      f"({', '.join(packaged)})")


def load_recipe(recipe: str | Path) -> dict:
    """The mapping of option names to values that ``recipe`` (a name or a file) holds."""
    path = resolve_recipe(recipe)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {recipe} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {recipe}: expected a mapping of option names to values (got {type(data).__name__})")
    return data


def _merged(recipe: str | Path | None, overrides: dict) -> tuple[dict, str]:
    """A recipe's mapping (if any) with the non-None ``overrides`` on top, and the origin its errors name."""
    data = load_recipe(recipe) if recipe else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return data, f"recipe {recipe}" if recipe else "options"


def convert_options(recipe: str | Path | None, overrides: dict) -> ConvertRequest:
    """The request of a recipe (if any) with the given non-None overrides on top."""
    data, origin = _merged(recipe, overrides)
    return ConvertRequest.from_dict(data, origin=origin)


# A run heads for one target: a --target-speedup given on top of a recipe replaces the recipe's target_ratio,
# and a --target-ratio its target_speedup.
TARGETS = ("target_ratio", "target_speedup")


def train_options(recipe: str | Path | None, overrides: dict) -> TrainOptions:
    """Training options from a recipe (if any) with the given non-None overrides on top (a target given
    replaces the recipe's other target: ``TARGETS``)."""
    data, origin = _merged(recipe, overrides)
    given = [name for name in TARGETS if overrides.get(name) is not None]
    if len(given) == 1:
        data = {name: value for name, value in data.items() if name not in TARGETS or name in given}
    return TrainOptions.from_dict(data, origin=origin)
