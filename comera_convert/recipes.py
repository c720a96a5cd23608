"""Recipes: YAML files of options (``comera convert --recipe FILE``, ``comera train --recipe FILE``).

Every key is a field of ConvertOptions (``conversion/options.py``) or TrainOptions
(``training/options.py``), which say what each means; command-line options override the recipe's.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from .conversion.options import ConvertOptions
from .errors import ConfigError
from .training.options import TrainOptions


def load_recipe(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path}: expected a mapping of option names to values (got {type(data).__name__})")
    return data


def convert_options(recipe: str | Path | None, overrides: dict) -> ConvertOptions:
    """Options from a recipe (if any) with the given non-None overrides on top."""
    data = load_recipe(recipe) if recipe else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    if data.get("rank") is not None and overrides.get("ratio") is None:
        data["ratio"] = None  # a rank replaces the default ratio unless a ratio was asked for too
    return ConvertOptions.from_dict(data, origin=str(recipe) if recipe else "options")


def train_options(recipe: str | Path | None, overrides: dict) -> TrainOptions:
    """Training options from a recipe (if any) with the given non-None overrides on top."""
    data = load_recipe(recipe) if recipe else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return TrainOptions.from_dict(data, origin=str(recipe) if recipe else "options")
