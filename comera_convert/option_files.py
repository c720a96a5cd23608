"""Building option dataclasses from mappings (recipes, CLI values) with errors that list the valid keys."""

from __future__ import annotations

from dataclasses import fields

from .errors import ConfigError


def from_mapping(cls, data: dict, origin: str = "options"):
    """``cls(**data)``, refusing unknown keys with the list of known ones; a value out of range is refused
    as the options refuse it, with ``origin`` (a recipe's file) named in front."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{origin}: unknown key(s) {', '.join(unknown)} "
                          f"(expected some of: {', '.join(sorted(known))})")
    try:
        return cls(**data)
    except ConfigError as err:
        if origin == "options":  # the command line's flags: the message names them already
            raise
        raise ConfigError(f"{origin}: {err}") from None
