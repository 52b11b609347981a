"""The ``ucp`` command: a small registry of sub-commands, one module each.

How to add a command (e.g. ``ucp inspect``):

1. create ``ucp/cli/inspect.py`` defining ``register(app: typer.Typer) -> None``,
   which adds either a command (``app.command("inspect")(inspect_cmd)``) or a
   group (``app.add_typer(inspect_app, name="inspect")``);
2. add ``"inspect"`` to ``COMMAND_MODULES`` below.

Keep module top levels light (typer, rich, pydantic): import torch and other heavy
packages inside the command functions, so that ``ucp --help`` answers at once.

``ucp NAME ...`` imports and registers only NAME's module (the one-shot commands pay for no other
command's imports, nor for typer building every command's options); ``ucp --help``, a mistyped
name and :data:`app` get them all.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Sequence

from ucp.cli import startup, timings
from ucp.shutdown import exit_now

if TYPE_CHECKING:
    import typer

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


def build_app(names: Sequence[str] = COMMAND_MODULES) -> typer.Typer:
    """The ``ucp`` app with the commands of ``names`` (modules of :data:`COMMAND_MODULES`) registered."""
    import typer  # here, not at the top: main() imports it with the cyclic GC paused

    app = typer.Typer(
        name="ucp",
        help="[bold]UCP[/bold]: universal checkpointing and storage I/O for large-model training.",
        rich_markup_mode="rich",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_show_locals=False,
    )
    # A callback keeps the app a group whatever the number of commands: with one command alone, typer
    # would make it the app itself (``ucp verify PATH`` would read "verify" as PATH).
    app.callback()(_group)
    for name in names:
        importlib.import_module(f"ucp.cli.{name}").register(app)
    return app


def _group() -> None:
    """The app's own (empty) callback: see :func:`build_app`."""


def command_named(argv: Sequence[str]) -> str | None:
    """The command ``argv`` (the arguments after ``ucp``) runs, when it is one of ours and comes first."""
    return argv[0] if argv and argv[0] in COMMAND_MODULES else None


def __getattr__(name: str) -> typer.Typer:
    """``app``: every command registered (``from ucp.cli.main import app``), built on first use."""
    if name == "app":
        app = globals()["app"] = build_app()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM's handler: unwind like Ctrl-C (cleanup runs), ending with 128 + the signal."""
    raise SystemExit(128 + signum)


def main() -> None:
    """The ``ucp`` console script (and ``python -m ucp.cli``): run the command, then exit at once.

    Every command has finished its work when it returns (files written, fsynced and committed);
    what the interpreter would still do after joining threads and running exit handlers is tear
    down its modules (torch's take ~0.4 s on the reference VM, a tenth of a small ``ucp convert``),
    so :func:`ucp.shutdown.exit_now` ends the process without that teardown.

    Start-up is mostly imports, made with the cyclic GC paused (:mod:`ucp.cli.startup`). Pydantic's
    plugins are not looked for (``PYDANTIC_DISABLE_PLUGINS``; a value set in the environment, even
    empty, is kept): finding them reads the entry points of every installed distribution (~2 % of a
    one-shot command's instructions).
    """
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    code: int | str | None = 0
    exit_started: list[float] = []
    if timings.ENABLED:  # registered first, so it runs after every exit handler a command registers
        atexit.register(lambda: timings.report(exit_started[0] if exit_started else time.perf_counter()))
    # SIGTERM (kill, timeout, a scheduler, docker stop) unwinds like Ctrl-C does, so a command's
    # cleanup runs (temporary directories removed) before the process ends with 128 + 15.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    command = command_named(sys.argv[1:])
    startup.own_process()
    with startup.paused_gc():
        app = build_app(COMMAND_MODULES if command is None else [command])
        # typer (0.29) converts each option's value through a pydantic TypeAdapter once the command runs:
        # load pydantic's model machinery now, with the GC paused, not then.
        from pydantic import TypeAdapter  # noqa: F401
    timings.mark("imports")  # UCP_TIMINGS=1: the interpreter's start-up and the command's module
    try:
        app(prog_name="ucp")
    except SystemExit as exc:
        code = exc.code
    exit_started.append(time.perf_counter())
    exit_now(code)


if __name__ == "__main__":
    main()
