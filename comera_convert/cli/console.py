"""The rich consoles the CLI prints to (rich stays in the CLI layer)."""

from __future__ import annotations

from rich.console import Console


def console() -> Console:
    return Console()


def error_console() -> Console:
    return Console(stderr=True)
