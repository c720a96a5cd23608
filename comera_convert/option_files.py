"""Building option dataclasses from mappings (recipes, CLI values) with errors that list the valid keys."""

from __future__ import annotations

from dataclasses import fields

from .errors import ConfigError


def from_mapping(cls, data: dict, origin: str = "options"):
    """``cls(**data)``, refusing unknown keys with the list of known ones."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{origin}: unknown key(s) {', '.join(unknown)} "
                          f"(expected some of: {', '.join(sorted(known))})")
    return cls(**data)
