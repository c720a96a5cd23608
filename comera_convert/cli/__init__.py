"""The `comera` command: a thin click shell over the library.

Each subcommand lives in its own module and imports the heavy parts (torch, transformers)
lazily, so `comera --help` is instant. Library errors become one red line and exit code 1.
"""

from .group import main

from . import bench_command, commands, train_command  # noqa: E402, F401  (registers the subcommands)

__all__ = ["main"]
