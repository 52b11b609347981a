"""Helpers shared by the CLI modules: consoles, progress bars, option parsing."""

from __future__ import annotations

import json
import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

# Human output goes to stdout; progress and errors to stderr, so `--json` stdout stays parseable.
# Piped or captured output gets a wide console so tables do not wrap into unreadable columns.
out = Console(width=None if sys.stdout is not None and sys.stdout.isatty() else 160)
err = Console(stderr=True)


@contextmanager
def prefetching(path: str | os.PathLike[str] | None, *, marker: str | None = "manifest.json") -> Iterator[None]:
    """Pull a local source into the page cache ahead of the command's reads (``aio.prefetch``).

    Commands that import torch enter it first thing, so the reads overlap the import, and call
    :func:`source_reads_start` once the heavy imports are done; ``reshape`` (no torch) enters it
    when it starts reading. Only a directory holding
    ``marker`` (a checkpoint, not whatever path was typed) is prefetched; URLs are left alone;
    ``UCP_PREFETCH=0`` turns it off; ``path=None`` means nothing to prefetch. A problem here never
    fails the command: it only means no prefetch. On the way out the files stop counting as
    prefetched.
    """
    started = False
    if path is not None and os.environ.get("UCP_PREFETCH", "1").lower() not in ("0", "false", "no", "off"):
        try:
            from aio.prefetch import prefetch_files

            p = os.fspath(path)
            if "://" not in p and (marker is None or os.path.isfile(os.path.join(p, marker))):
                prefetch_files([p])
                started = True
        except Exception:  # noqa: BLE001 - an optimisation; the command reports real problems itself
            pass
    try:
        yield
    finally:
        if started:
            from aio.prefetch import forget, promote

            promote()
            forget()


def source_reads_start() -> None:
    """The command's own I/O begins: queue what is left of its prefetch at normal priority."""
    module = sys.modules.get("aio.prefetch")
    if module is not None:
        module.promote()


def fail(message: str, code: int = 1) -> "typer.Exit":
    """Print a one-line error to stderr (never wrapped, so scripts can grep it) and return the Exit to raise.

    The message is printed as is: brackets in it ("[key, value]") are not rich markup."""
    err.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def command_line() -> str:
    """The command as the user typed it, for reports that must say how numbers were made."""
    prog = Path(sys.argv[0]).name
    if prog == "__main__.py":
        prog = "python -m ucp.cli"
    elif prog.endswith(".py"):
        prog = "python " + os.path.relpath(sys.argv[0])
    return " ".join([prog, shlex.join(sys.argv[1:])]).strip()


def split_csv(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [part.strip() for part in text.split(",") if part.strip()]


def load_aio_config(path: Path | None):  # -> aio.AioConfig (imported lazily)
    """Read an aio config file: ``ucp tune`` output, a DeepSpeed config, or a flat AioConfig."""
    from aio import AioConfig
    from aio.tune import config_from_json

    if path is None:
        return AioConfig()
    try:
        return config_from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise fail(f"cannot use {path} as an aio config: {exc}") from exc


@contextmanager
def progress_bar(
    description: str, *, enabled: bool = True, percent: bool = False
) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar on stderr; yields ``update(done, total, what)``. Hidden when not a terminal.

    ``percent``: show how far as a percentage rather than ``done/total`` (for work whose phases count in
    different units, e.g. files read, then bytes written).
    """
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn() if percent else MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[what]}"),
        console=err,
        transient=True,
        disable=not (enabled and err.is_terminal),
    )
    with progress:
        task = progress.add_task(description, total=None, what="")

        def update(done: int, total: int, what: str) -> None:
            progress.update(task, completed=done, total=total, what=what)

        yield update
