"""``ucp verify PATH``: check a checkpoint end to end — manifest, every file's size and header,
every piece's CRC-32C — and say exactly what is wrong.

Exit codes (:func:`ucp.cli.common.exit_code`, as for every command): 0 clean, 1 problems found
(damaged data or manifest, a storage failure), 2 the path does not exist or is not a checkpoint
(or not one of a format version this reader knows), or an option is invalid.
With ``--json`` stdout always holds one :class:`VerifyOutput`, whatever the exit code.
"""

# No ``from __future__ import annotations``: typer reads the parameters' annotations, which would then be
# strings it compiles and evaluates on every run (~2 % of a one-shot command's instructions).

import ast
import inspect
import re
import time
from contextlib import contextmanager
from typing import Annotated, Any, Callable, Iterator, Optional

import typer
from pydantic import BaseModel, Field
from rich.markup import escape

from aio.sizes import format_size
from ucp.cli import startup
from ucp.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    STORAGE_OPTIONS_HELP,
    err,
    exit_code,
    load_storage_options,
    out,
    small_job_engine,
    unreadable_message,
)
from ucp.cli.timings import phase

EXIT_PROBLEMS = EXIT_FAILED

# The location part of UCP's messages (ucp.errors.where): "tensor 'x', file 'f', offset 4096".
_TENSOR = re.compile(r"tensor ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")
_OFFSET = re.compile(r"\boffset (\d+)")


class ProblemOut(BaseModel):
    kind: str
    message: str
    file: str | None = None
    tensor: str | None = Field(None, description="the tensor the message names, if any")
    offset: int | None = Field(None, description="the byte offset in the file the message names, if any")


class VerifyOutput(BaseModel):
    """What ``ucp verify --json`` prints."""

    path: str
    ok: bool
    exit_code: int
    format_version: int | None = None
    step: int | None = None
    files_checked: int = 0
    tensors: int = 0
    pieces_checked: int = 0
    bytes_checked: int = 0
    bytes_total: int = Field(0, description="bytes of all data files the manifest lists")
    seconds: float
    problems: list[ProblemOut] = []


def _locate(message: str) -> tuple[str | None, int | None]:
    """(tensor, offset) named in a UCP error message, when it names them."""
    tensor = None
    m = _TENSOR.search(message)
    if m:
        try:
            tensor = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            tensor = None
    o = _OFFSET.search(message)
    return tensor, int(o.group(1)) if o else None


def to_output(report: Any, seconds: float) -> VerifyOutput:
    """A ``ucp.VerifyReport`` as the CLI's output; each problem's tensor/offset taken from the report,
    or from its message where the report does not carry them."""
    problems = []
    for p in report.problems:
        tensor, offset = getattr(p, "tensor", None), getattr(p, "offset", None)
        if tensor is None or offset is None:
            t, o = _locate(p.message)
            tensor, offset = tensor if tensor is not None else t, offset if offset is not None else o
        problems.append(ProblemOut(kind=p.kind, message=p.message, file=p.file, tensor=tensor, offset=offset))
    code = EXIT_OK if report.ok else max(_kind_exit_code(p.kind) for p in problems) if problems else EXIT_PROBLEMS
    return VerifyOutput(
        path=report.path,
        ok=report.ok,
        exit_code=code,
        format_version=report.format_version,
        step=report.step,
        files_checked=report.files_checked,
        tensors=report.tensors,
        pieces_checked=report.pieces_checked,
        bytes_checked=report.bytes_checked,
        bytes_total=getattr(report, "bytes_total", report.bytes_checked),
        seconds=round(seconds, 3),
        problems=problems,
    )


def _kind_exit_code(kind: str) -> int:
    """A problem's exit code, from the error class it names (``ucp.errors`` or a builtin); 1 for others."""
    import builtins

    from ucp import errors

    cls = getattr(errors, kind, None) or getattr(builtins, kind, None)
    return exit_code(cls) if isinstance(cls, type) and issubclass(cls, Exception) else EXIT_PROBLEMS


@contextmanager
def _byte_progress(description: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar over bytes on stderr (hidden when stderr is not a terminal); yields its callback."""
    if not err.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _print(result: VerifyOutput) -> None:
    if result.ok:
        rate = result.bytes_checked / result.seconds / 1e9 if result.seconds > 0 else 0.0
        out.print(
            f"[bold green]OK[/bold green] {result.path}: {result.files_checked} files, {result.tensors} tensors, "
            f"{result.pieces_checked} pieces, {format_size(result.bytes_checked)} checked in {result.seconds:.2f} s "
            f"({rate:.2f} GB/s)",
            highlight=False,
        )
        return
    if result.exit_code == EXIT_BAD_INPUT or all(p.file is None for p in result.problems):
        _print_errors(result)  # nothing could be checked: say why, as for every command
        return
    out.print(
        f"[bold red]PROBLEMS[/bold red] {escape(result.path)}: {len(result.problems)} file(s) failed the "
        f"check ({result.files_checked} files passed)",
        highlight=False,
    )
    for p in result.problems:
        # UCP's messages start with their location (tensor, file, offset); add the file when one does not.
        text = p.message if p.file is None or repr(p.file) in p.message else f"file {p.file!r}: {p.message}"
        out.print(f"  [red]{p.kind}[/red]: {escape(text)}", highlight=False, soft_wrap=True)


def _print_errors(result: VerifyOutput) -> None:
    """An unreadable checkpoint's problems as ``error:`` lines on stderr."""
    for p in result.problems:
        err.print(f"[bold red]error:[/bold red] {escape(p.message)}", highlight=False, soft_wrap=True)


def _unchecked(path: str, kind: str, message: str, code: int, seconds: float = 0.0) -> VerifyOutput:
    """The output when nothing could be checked (a bad option, a checkpoint that cannot be opened)."""
    return VerifyOutput(
        path=path,
        ok=False,
        exit_code=code,
        seconds=round(seconds, 3),
        problems=[ProblemOut(kind=kind, message=message)],
    )


def _verify(path: str, options: dict[str, Any] | None) -> VerifyOutput:
    """Run ``ucp.verify`` (with a progress bar on a terminal); exit 2 when it cannot even start."""
    with startup.imports():
        import ucp

        verify = ucp.verify  # resolved here (ucp's exports are lazy), so its imports count as imports

    t0 = time.perf_counter()
    try:
        with small_job_engine(path), _byte_progress("verify") as progress, phase("io"):
            if progress is not None and "progress" in inspect.signature(verify).parameters:
                report = verify(path, storage_options=options, progress=progress)
            else:
                report = verify(path, storage_options=options)
    except (OSError, ValueError, ImportError) as exc:  # ucp.CheckpointError is a ValueError
        message = unreadable_message(path, exc)
        return _unchecked(path, type(exc).__name__, message, exit_code(exc), time.perf_counter() - t0)
    return to_output(report, time.perf_counter() - t0)


def verify_cmd(
    path: Annotated[str, typer.Argument(help="Checkpoint directory or fsspec URL.")],
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
    storage_options: Annotated[Optional[str], typer.Option("--storage-options", help=STORAGE_OPTIONS_HELP)] = None,
) -> None:
    """Check every piece's CRC-32C, every data file's size and header, and the manifest.

    Exit code 0: clean; 1: problems found (each named by tensor, file and offset); 2: PATH does not exist or
    is not a checkpoint, or an option is invalid.
    """
    try:
        options = load_storage_options(storage_options)
    except ValueError as exc:  # the message names the option
        result = _unchecked(path, "UsageError", str(exc), EXIT_BAD_INPUT)
    else:
        result = _verify(path, options)
    if json_output:
        typer.echo(result.model_dump_json(indent=2))
        if result.problems and all(p.file is None for p in result.problems):  # on stderr too: scripts show that
            _print_errors(result)
    else:
        _print(result)
    raise typer.Exit(result.exit_code)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify_cmd)
