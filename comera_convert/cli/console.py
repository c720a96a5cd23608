"""The rich consoles the CLI prints to, and its progress display (rich stays in the CLI layer).

`comera --quiet` silences everything but errors and --json output; progress is drawn only on a
terminal (a pipe or a log file gets the results, not a stream of redraws).
"""

from __future__ import annotations

import contextlib
import logging

import click
from rich.console import Console


def quiet() -> bool:
    """Whether the running command was given `comera --quiet` (read from click's context)."""
    context = click.get_current_context(silent=True)
    return bool(context and context.find_root().params.get("quiet"))


def console() -> Console:
    return Console(quiet=quiet())


def error_console() -> Console:
    return Console(stderr=True)


def progress_console() -> Console | None:
    """The stderr console progress is drawn on, or None where none is drawn (--quiet, or stderr is a
    pipe or a log file)."""
    stderr = Console(stderr=True)
    return None if quiet() or not stderr.is_terminal else stderr


@contextlib.contextmanager
def progress_display():
    """Yield ``update(description, done=None, total=None)`` for the library's ``progress`` hooks: a
    bar while ``total`` is known, a spinner with the elapsed time while it is not; transient,
    drawn on stderr, and off under --quiet or when stderr is not a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    stderr = progress_console()
    bar = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=stderr or Console(stderr=True), transient=True,
                   disable=stderr is None)
    with bar:
        task = bar.add_task("starting", total=None)

        def update(description: str, done: int | None = None, total: int | None = None) -> None:
            bar.update(task, description=description, completed=done or 0, total=total)

        yield update


class ConsoleLogHandler(logging.Handler):
    """The library's log records as one line each on stderr: warnings in yellow, the rest dim."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING and quiet():
            return
        style = "[yellow]warning:[/] " if record.levelno >= logging.WARNING else "[dim]"
        error_console().print(f"{style}{self.format(record)}", highlight=False, soft_wrap=True)


def show_library_logs(name: str = "comera_convert", level: int = logging.INFO) -> None:
    """Route the ``name`` logger's records through ConsoleLogHandler (once), not Python's bare stderr."""
    logger = logging.getLogger(name)
    if not any(isinstance(h, ConsoleLogHandler) for h in logger.handlers):
        logger.addHandler(ConsoleLogHandler())
    logger.setLevel(level)
    logger.propagate = False


def echo_json(payload) -> None:
    """JSON on stdout (what --json prints, also under --quiet)."""
    import json

    click.echo(json.dumps(payload, indent=2, default=str))
