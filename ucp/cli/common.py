"""Helpers shared by the CLI modules: consoles, exit codes, error lines, progress bars, option parsing.

Exit codes, the same for every command (:func:`exit_code` maps an error to one):

* 0 — done;
* 1 — the data is damaged, a check failed, or the work itself failed (an I/O error, a bench that broke);
* 2 — bad input: an invalid option, a path that does not exist, something that is not a checkpoint
  (or not one this version reads), a destination that is in the way.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from ucp.cli.timings import phase

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

# Output that is not a terminal (a pipe, a file, a test's capture) has no width: rich would wrap it at
# 80 columns, breaking lines a script greps ("1 \ntensors"). So there lines are never wrapped and tables
# take the width they need.
UNWRAPPED_WIDTH = 10_000


def make_console(*, stderr: bool = False) -> Console:
    """A console on stdout (or stderr): the terminal's width on a terminal, else never wrapped.

    No emoji codes: names, paths and messages are printed as they are (``:smile:`` in a tensor name stays
    that), and rich's table of codes is not even imported."""
    stream = sys.stderr if stderr else sys.stdout
    if stream is not None and stream.isatty():
        return Console(stderr=stderr, emoji=False)
    return Console(stderr=stderr, width=UNWRAPPED_WIDTH, soft_wrap=True, emoji=False)


# Human output goes to stdout; progress and errors to stderr, so `--json` stdout stays parseable.
out = make_console()
err = make_console(stderr=True)


def exit_code(exc: BaseException | type[BaseException]) -> int:
    """The exit code for an error (or an error class), for every command: 2 bad input, 1 damaged data or
    failed work.

    The one mapping of error classes to exit codes (see the module docstring); commands call
    :func:`fail_with` rather than choosing a code themselves.
    """
    from ucp.errors import (
        BenchOptionError,
        CheckpointError,
        DestinationError,
        ExportError,
        NotACheckpointError,
        UnsafePickleError,
        UnsupportedFormatError,
    )

    bad_input = (
        NotACheckpointError,  # also UnknownFormatError: not a checkpoint of any known format
        UnsupportedFormatError,  # a checkpoint of a format version this reader does not know
        UnsafePickleError,  # needs --trust-pickle
        ExportError,  # an export option, or a destination in the way
        BenchOptionError,  # a bench method or world size that does not exist
        DestinationError,  # DST exists (no --overwrite), is not a checkpoint, or holds SRC
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
        FileExistsError,
        ImportError,  # a URL whose fsspec backend is not installed
    )
    cls = exc if isinstance(exc, type) else type(exc)
    if issubclass(cls, bad_input):
        return EXIT_BAD_INPUT
    if issubclass(cls, (CheckpointError, OSError)):
        return EXIT_FAILED
    if issubclass(cls, ValueError):  # a value given that is wrong (an option, a layout pattern, a URL)
        return EXIT_BAD_INPUT
    return EXIT_FAILED


def one_line(exc: BaseException) -> str:
    """An exception's message as one line, without its class name; OSErrors keep their file name."""
    text = str(exc).strip().replace("\n", " ")
    if isinstance(exc, OSError):
        text = re.sub(r"^\[Errno \d+\] ", "", text)  # the code says nothing the reason does not
        if exc.filename is not None and str(exc.filename) not in text:
            text = f"{exc.filename}: {text}"
    return text or type(exc).__name__


def fail_with(exc: BaseException, message: str | None = None) -> "typer.Exit":
    """Print ``message`` (default: the error as :func:`one_line`) and return the Exit that
    :func:`exit_code` gives ``exc``."""
    return fail(one_line(exc) if message is None else message, exit_code(exc))


@contextmanager
def prefetching(path: str | os.PathLike[str] | None, *, marker: str | None = "manifest.json") -> Iterator[None]:
    """Pull a local source into the page cache ahead of the command's reads (``aio.prefetch``).

    Commands enter it first thing, so the reads overlap their imports and set-up, and call
    :func:`source_reads_start` once the heavy imports are done. Only a directory holding
    ``marker`` (a checkpoint, not whatever path was typed) is prefetched; URLs are left alone;
    ``UCP_PREFETCH=0`` turns it off; ``path=None`` means nothing to prefetch. A problem here never
    fails the command: it only means no prefetch. On the way out the files stop counting as
    prefetched.
    """
    started = False
    if path is not None and os.environ.get("UCP_PREFETCH", "1").lower() not in ("0", "false", "no", "off"):
        try:
            with phase("imports"):
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


SMALL_SOURCE_BYTES = 64 << 20
"""A source up to this size is moved with aio's thread engine (:func:`small_job_engine`)."""


@contextmanager
def small_job_engine(path: str | os.PathLike[str] | None) -> Iterator[None]:
    """Within the block, aio's ``engine="auto"`` is the thread engine when ``path`` (a local file or directory,
    the command's source) holds at most :data:`SMALL_SOURCE_BYTES`; otherwise nothing changes.

    Why: a process that made a kernel AIO context waits ~35 ms when it ends (the context's teardown waits
    for an RCU grace period), about what the thread engine takes to move 64 MiB here; a one-shot command
    on a small checkpoint would spend more on that than on its data. URLs and ``None`` change nothing.
    """
    chosen = False
    if path is not None and "://" not in os.fspath(path):
        from aio.engines import set_auto_engine
        from aio.prefetch import regular_files

        try:
            small = sum(size for _, size in regular_files(os.fspath(path))) <= SMALL_SOURCE_BYTES
        except OSError:  # the command says what is wrong with its source itself
            small = False
        if small:
            set_auto_engine("threads")
            chosen = True
    try:
        yield
    finally:
        if chosen:
            from aio.engines import set_auto_engine

            set_auto_engine(None)


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


def bad_input(message: str) -> typer.Exit:
    """Print a one-line error and return the exit-2 (bad input) to raise."""
    return fail(message, EXIT_BAD_INPUT)


def load_storage_options(text: str | None) -> dict[str, Any] | None:
    """``--storage-options`` JSON -> dict (fsspec keyword arguments); ValueError saying what is wrong."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--storage-options is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--storage-options must be a JSON object")
    return value


def parse_storage_options(text: str | None) -> dict[str, Any] | None:
    """:func:`load_storage_options`, a bad value printed as a one-line error (exit 2)."""
    try:
        return load_storage_options(text)
    except ValueError as exc:
        raise bad_input(str(exc)) from None


def url_storage_options(text: str | None) -> dict[str, Any] | None:
    """:func:`parse_storage_options`, also made the default of every URL the command opens
    (``ucp.store.storage.set_default_storage_options``): for commands that open their URLs deep inside."""
    from ucp.store.storage import set_default_storage_options

    options = parse_storage_options(text)
    set_default_storage_options(options)
    return options


F = TypeVar("F", bound=Callable[..., Any])


def scoped_url_options(command: F) -> F:
    """Wrap a command that calls :func:`url_storage_options` so that its default ends with it (a command
    run in-process, by tests or scripts, leaves no storage options behind for what runs next)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        from ucp.store.storage import set_default_storage_options

        try:
            return command(*args, **kwargs)
        finally:
            set_default_storage_options(None)

    return run  # type: ignore[return-value]


STORAGE_OPTIONS_HELP = (
    "Options for URLs as JSON: for s3:// the keys of ucp.store.s3.S3Options (endpoint_url, key, secret, region, "
    "part_size, concurrency, max_retries ...; the AWS_* environment variables otherwise), for other URLs fsspec's."
)


def unreadable_message(path: str, exc: BaseException) -> str:
    """Why the checkpoint at ``path`` cannot be read, as one line naming it. UCP's errors name the
    manifest already; others (an unknown URL protocol, a missing fsspec backend) get the path."""
    from ucp.errors import CheckpointError

    text = one_line(exc)
    if (
        not isinstance(exc, CheckpointError)
        and not (isinstance(exc, OSError) and exc.filename is not None)
        and path not in text
    ):
        text = f"{path}: {text}"
    return text


def require_dir(path: Path | None, option: str) -> None:
    """Exit 2 with one line unless ``path`` (an option's value; None: not given) is an existing directory.

    A bench or tune must measure the disk the user named: creating a mistyped directory elsewhere
    would measure the wrong one."""
    if path is None:
        return
    if not path.exists():
        raise fail(f"{option} {path} does not exist (create it first: the directory says which disk to measure)", 2)
    if not path.is_dir():
        raise fail(f"{option} {path} is not a directory", 2)


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
        raise fail(f"cannot use {path} as an aio config: {exc}", EXIT_BAD_INPUT) from exc


@contextmanager
def progress_bar(
    description: str, *, enabled: bool = True, percent: bool = False
) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar on stderr; yields ``update(done, total, what)``. Hidden when not a terminal.

    ``percent``: show how far as a percentage rather than ``done/total`` (for work whose phases count in
    different units, e.g. files read, then bytes written). With no bar to show, ``rich.progress`` is not
    even imported (a one-shot command in a script pays nothing for it).
    """
    if not (enabled and err.is_terminal):
        yield _no_progress
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn() if percent else MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[what]}"),
        console=err,
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=None, what="")

        def update(done: int, total: int, what: str) -> None:
            progress.update(task, completed=done, total=total, what=what)

        yield update


def _no_progress(done: int, total: int, what: str) -> None:
    """:func:`progress_bar`'s update when no bar is shown."""
