"""Building option dataclasses from mappings (recipes, CLI values) with errors that list the valid keys."""

from __future__ import annotations

from dataclasses import field, fields

from .errors import ConfigError


GIVEN = "given"  # a plan's reason for a choice the options made themselves (conversion's and training's)


def option(default, concern: str, help: str, **cli):
    """A field of an option dataclass: its default, the concern it belongs to (one of the class's
    ``CONCERNS``) and how the CLI offers it: ``help``; ``cli``: ``flag`` (the declaration, or a tuple of
    aliases, e.g. "--modes" or "--compensate/--no-compensate"), ``type``, ``metavar``, ``choices``,
    ``parse`` (how the flag's text becomes the value), ``flag_value`` (a bare flag's value), ``cli=False``
    (not offered)."""
    return field(default=default, metadata={"concern": concern, "help": help, **cli})


def offered_fields(cls) -> list:
    """The fields of ``cls`` the CLI offers as flags, in the order of ``cls.CONCERNS``."""
    offered = [f for f in fields(cls) if f.metadata.get("cli", True)]
    unknown = [f.name for f in offered if f.metadata.get("concern") not in cls.CONCERNS]
    if unknown:
        raise ValueError(f"{cls.__name__} fields without a concern of {cls.CONCERNS}: {unknown}")
    return sorted(offered, key=lambda f: cls.CONCERNS.index(f.metadata["concern"]))


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
