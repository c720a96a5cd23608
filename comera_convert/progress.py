"""The progress hook the library's long jobs take: ``progress(description, done, total)``.

A job calls it when it starts a stage (``done``/``total`` None: not countable, such as loading)
and as it counts through one (converting module 3 of 39). The CLI draws it; library callers may
pass their own or nothing.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, "int | None", "int | None"], None]


def no_progress(description: str, done: int | None = None, total: int | None = None) -> None:
    """The default hook: says nothing."""
