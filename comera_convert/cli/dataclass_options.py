"""`comera convert`'s and `comera train`'s flags, generated from the fields of ConvertRequest
(``request.py``) and TrainOptions (``training/options.py``): each field's help, choices, type and flag name
are written once, on the field (``option_files.option``), so the CLI cannot drift from the library.

Every flag defaults to None ("not given"), so that a recipe's value stands unless the flag overrides it;
the "[default: ...]" in each help says what the plan or the options then choose.
"""

from __future__ import annotations

import json
from dataclasses import Field
from pathlib import Path

import click

from ..errors import ConfigError
from ..option_files import offered_fields


def flags_from(cls):
    """A decorator adding to a click command one option per offered field of ``cls``, in the order of their
    concerns; each fills the parameter of the field's name and is listed under its concern in --help
    (with ``SectionedCommand``)."""
    def decorate(command):
        for spec in reversed(offered_fields(cls)):
            command = click.option(*_names(spec), cls=ConcernOption, concern=spec.metadata["concern"],
                                   **_settings(spec))(command)
        return command
    return decorate


class ConcernOption(click.Option):
    """An option that knows the concern its field belongs to (how ``SectionedCommand`` groups --help)."""

    def __init__(self, *args, concern: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.concern = concern


class SectionedCommand(click.Command):
    """A command whose --help lists its options under their concerns ("Rank budget options:", ...), the
    command's own options last."""

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "concern", "other"), []).append(record)
        sections["other"] = sections.pop("other", [])  # the command's own, after the concerns
        for concern, records in sections.items():
            with formatter.section(f"{concern[0].upper()}{concern[1:]} options"):
                formatter.write_dl(records)


def _names(spec: Field) -> tuple[str, ...]:
    """The flag's declarations and the parameter it fills: the field's name, whatever the flag is called."""
    flag = spec.metadata.get("flag") or "--" + spec.name.replace("_", "-")
    return (*((flag,) if isinstance(flag, str) else flag), spec.name)


def _settings(spec: Field) -> dict:
    meta = spec.metadata
    settings = {"default": None, "help": meta["help"]}
    if "flag_value" in meta:  # a flag that turns a default off (--no-gates)
        return {**settings, "is_flag": True, "flag_value": meta["flag_value"]}
    if "/" in str(meta.get("flag") or ""):  # --compensate/--no-compensate
        return settings
    if "choices" in meta:
        settings["type"] = click.Choice(meta["choices"])
    elif meta.get("parse") == "rank-scales":
        settings["type"] = click.Path(exists=True, dir_okay=False)
        settings["callback"] = lambda ctx, param, value: rank_scales(value) if value else None
    elif meta.get("parse") == "patterns":
        settings["callback"] = lambda ctx, param, value: patterns(value)
    elif "type" in meta:
        settings["type"] = meta["type"]
    if "metavar" in meta:
        settings["metavar"] = meta["metavar"]
    return settings


def patterns(value: str | None) -> list[str] | None:
    """Comma-separated module-name patterns as a list (None where none were given)."""
    return [p.strip() for p in value.split(",") if p.strip()] if value else None


def rank_scales(file: str) -> dict:
    """The per-layer rank scales in ``file``: a JSON object of them, or a report recording learned ones."""
    try:
        data = json.loads(Path(file).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--rank-scales {file}: expected a JSON file ({err})") from None
    if isinstance(data, dict) and isinstance(data.get("extra"), dict) and "modules" in data:  # a report
        if "rank_scales" not in data["extra"]:
            raise ConfigError(f"--rank-scales {file}: this report records no learned rank scales (the conversion "
                              f"used the {data['extra'].get('allocation', 'uniform')} allocation)")
        data = data["extra"]["rank_scales"]
    return data
