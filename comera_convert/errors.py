"""The exceptions comera_convert raises: one small hierarchy, one-line messages.

Every message says what was expected and what came in, so the CLI can print it as it is.
"""


class ComeraError(Exception):
    """Base class of every error comera_convert raises on purpose."""


class ShapeError(ComeraError, ValueError):
    """Modes, ranks or tensor shapes that do not fit together."""


class ConfigError(ComeraError, ValueError):
    """An option or recipe value that is out of range or of the wrong kind."""


class SourceError(ConfigError):
    """A text source that cannot be read, named by the option that gave it (``--data`` unless the caller
    says otherwise: ``comera convert`` reads ``--calibration``)."""

    def __init__(self, detail: str, option: str = "--data"):
        self.detail, self.option = detail, option
        super().__init__(f"{option} {detail}")

    def named(self, option: str) -> "SourceError":
        """The same failure, worded for the option the user typed."""
        return SourceError(self.detail, option)


class ModelLoadError(ComeraError):
    """A model or checkpoint that cannot be found, read or trusted."""


class RatioError(ComeraError, ValueError):
    """A compression ratio that cannot be reached with the chosen targets."""


def expected(what: str, got: object) -> str:
    """Word an error as 'expected X (got Y)'."""
    return f"expected {what} (got {got!r})"
