"""The ``ucp`` command: a small registry of sub-commands, one module each.

How to add a command (e.g. ``ucp inspect``):

1. create ``ucp/cli/inspect.py`` defining ``register(app: typer.Typer) -> None``,
   which adds either a command (``app.command("inspect")(inspect_cmd)``) or a
   group (``app.add_typer(inspect_app, name="inspect")``);
2. add ``"inspect"`` to ``COMMAND_MODULES`` below.

Keep module top levels light (typer, rich, pydantic): import torch and other heavy
packages inside the command functions, so that ``ucp --help`` answers at once.
"""

from __future__ import annotations

import atexit
import importlib
import signal
import time

import typer

from ucp.cli import timings
from ucp.shutdown import exit_now

# Sub-command modules under ucp/cli/, in the order their commands are listed in --help.
COMMAND_MODULES: list[str] = [
    "demo",
    "bench",
    "tune",
    "inspect",
    "verify",
    "ls",
    "reshape",
    "convert",
    "export",
    "infer",
]

app = typer.Typer(
    name="ucp",
    help="[bold]UCP[/bold]: universal checkpointing and storage I/O for large-model training.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

for _name in COMMAND_MODULES:
    importlib.import_module(f"ucp.cli.{_name}").register(app)
timings.mark("imports")  # UCP_TIMINGS=1: the interpreter's start-up and the command modules


def _exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM's handler: unwind like Ctrl-C (cleanup runs), ending with 128 + the signal."""
    raise SystemExit(128 + signum)


def main() -> None:
    """The ``ucp`` console script (and ``python -m ucp.cli``): run the command, then exit at once.

    Every command has finished its work when it returns (files written, fsynced and committed);
    what the interpreter would still do after joining threads and running exit handlers is tear
    down its modules (torch's take ~0.4 s on the reference VM, a tenth of a small ``ucp convert``),
    so :func:`ucp.shutdown.exit_now` ends the process without that teardown.
    """
    code: int | str | None = 0
    exit_started: list[float] = []
    if timings.ENABLED:  # registered first, so it runs after every exit handler a command registers
        atexit.register(lambda: timings.report(exit_started[0] if exit_started else time.perf_counter()))
    # SIGTERM (kill, timeout, a scheduler, docker stop) unwinds like Ctrl-C does, so a command's
    # cleanup runs (temporary directories removed) before the process ends with 128 + 15.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        app(prog_name="ucp")
    except SystemExit as exc:
        code = exc.code
    exit_started.append(time.perf_counter())
    exit_now(code)


if __name__ == "__main__":
    main()
