"""The rich consoles the CLI prints to (rich stays in the CLI layer)."""

from __future__ import annotations

import logging

from rich.console import Console


def console() -> Console:
    return Console()


def error_console() -> Console:
    return Console(stderr=True)


class ConsoleLogHandler(logging.Handler):
    """The library's log records as one line each on stderr: warnings in yellow, the rest dim."""

    def emit(self, record: logging.LogRecord) -> None:
        style = "[yellow]warning:[/] " if record.levelno >= logging.WARNING else "[dim]"
        error_console().print(f"{style}{self.format(record)}", highlight=False, soft_wrap=True)


def show_library_logs(name: str = "comera_convert", level: int = logging.INFO) -> None:
    """Route the ``name`` logger's records through ConsoleLogHandler (once), not Python's bare stderr."""
    logger = logging.getLogger(name)
    if not any(isinstance(h, ConsoleLogHandler) for h in logger.handlers):
        logger.addHandler(ConsoleLogHandler())
    logger.setLevel(level)
    logger.propagate = False
