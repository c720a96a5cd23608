"""The `comera` group: its options, and comera_convert's errors turned into one red line and exit code 1.
The subcommands register on ``main`` from their own modules (``cli/__init__.py`` imports them)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import click

from .. import __version__
from ..errors import ComeraError

# bitsandbytes (which peft imports, and transformers' Trainer imports peft where it is installed)
# warns on import about optional kernels of its own; nothing comera runs uses them.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


ARGV_KEY = "comera.argv"  # the command line as given, for the report and model card (ctx.meta)


class ComeraGroup(click.Group):
    """A click group that turns comera_convert's errors into one line and a non-zero exit."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[ARGV_KEY] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        on_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if on_main_thread else None
        try:
            return super().invoke(ctx)
        except ComeraError as err:
            from .console import error_console

            error_console().print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
            sys.exit(1)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as err:  # not foreseen: a dependency that moved, or a bug of ours
            from rich.markup import escape

            from .console import error_console
            from .failures import describe_failure, show_traceback

            if show_traceback():
                raise
            error_console().print(f"[bold red]error:[/] {escape(describe_failure(err))}", highlight=False,
                                  soft_wrap=True)
            sys.exit(1)
        finally:
            if on_main_thread:
                signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM (kill, a job scheduler, torchrun stopping its workers) ends a command as Ctrl-C does:
    the exit unwinds, so what it was writing (a conversion's spool, a temporary output folder) is
    removed, where Python's default would leave it; the exit code is a plain SIGTERM's, 143."""
    raise SystemExit(128 + signal.SIGTERM)


def _default_sigterm_in_forked_child() -> None:
    """A process forked while a command runs gets SIGTERM's default back. Python runs a handler only between
    bytecodes, so a child inheriting ``_exit_on_sigterm`` outlives ``terminate()`` while it waits in C: OpenVINO's
    telemetry forks a sender that waits in getaddrinfo on an offline machine, and multiprocessing's exit joins
    it, holding the command at its end for as long as name resolution hangs."""
    if signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if hasattr(os, "register_at_fork"):  # POSIX only: Windows has no fork
    os.register_at_fork(after_in_child=_default_sigterm_in_forked_child)


@click.group(cls=ComeraGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="comera")
@click.option("-q", "--quiet", is_flag=True, help="Print only errors and --json output: no tables, notes or progress.")
def main(quiet: bool) -> None:
    """Tensor-train compression of Hugging Face models (CoMERA).

    Convert a model with `comera convert`, inspect it with `comera report`,
    get a dense checkpoint back with `comera decompress`.
    """
    quiet_transformers()


def quiet_transformers() -> None:
    """transformers' own tqdm bars and load reports would interleave with our output: silence them.
    Where transformers is not imported yet (``comera CMD --help`` never imports it), its environment
    variables say the same when it loads, so the group's callback costs no import."""
    if "transformers.utils.logging" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
