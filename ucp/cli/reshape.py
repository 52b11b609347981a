"""``ucp reshape SRC DST``: rewrite a checkpoint for another TP/PP/DP/ZeRO layout, or consolidate it.

The target is the layout SRC recorded (the training engine and the DeepSpeed importer record it) with
the mesh axes and ZeRO stage given on the command line changed, or a layout file (``--layout``), or the
reference GPT preset (``--model``). A checkpoint that recorded none is taken to be plain DP/ZeRO
(:func:`reshard.plain_layout`: every tensor replicated, the parameters one ZeRO group), so ``--dp``
and ``--zero`` work on any checkpoint; ``--tp``/``--pp`` above 1 then need a layout file or preset. With no
target at all, the checkpoint is consolidated: one piece per tensor, one file.

Exit codes (:func:`ucp.cli.common.exit_code`, as for every command): 0 written (and with ``--verify``
read back clean); 1 SRC's data is damaged, writing failed, or the ``--verify`` read-back found
problems (listed on stdout, or as ``problems`` in the ``--json`` object); 2 bad input: an invalid
option or target layout, SRC missing or not a checkpoint, DST already there (without ``--overwrite``). Errors are one ``error:`` line on stderr (a layout pattern error
adds the pattern with a caret under the part at fault).
"""

# No ``from __future__ import annotations``: typer reads the parameters' annotations, which would then be
# strings it compiles and evaluates on every run (~2 % of a one-shot command's instructions).

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from aio import memstat
from aio.sizes import SIZE_HELP, parse_size
from ucp.cli import startup
from ucp.cli.common import (
    EXIT_FAILED,
    STORAGE_OPTIONS_HELP,
    bad_input,
    command_line,
    fail_with,
    one_line,
    out,
    prefetching,
    progress_bar,
    scoped_url_options,
    small_job_engine,
    source_reads_start,
    url_storage_options,
)
from ucp.cli.timings import phase

EXIT_PROBLEMS = EXIT_FAILED  # --verify found problems in what was written


def reshape_cmd(
    src: Annotated[str, typer.Argument(help="Checkpoint to read (a directory or an fsspec URL).")],
    dst: Annotated[str, typer.Argument(help="Where to write the reshaped checkpoint (must not exist).")],
    tp: Annotated[Optional[int], typer.Option("--tp", min=1, help="Target tensor-parallel size.")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", min=1, help="Target pipeline-parallel size.")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", min=1, help="Target data-parallel size.")] = None,
    zero: Annotated[Optional[int], typer.Option("--zero", min=0, max=3, help="Target ZeRO stage (0-3).")] = None,
    layout_file: Annotated[
        Optional[Path],
        typer.Option(
            "--layout",
            help="A layout JSON file (docs/patterns.md) as the target; the flags above override its mesh/stage.",
        ),
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option(
            "--model",
            help="Base layout: the reference GPT preset of this name (for checkpoints that recorded no layout).",
        ),
    ] = None,
    memory_budget: Annotated[
        Optional[str],
        typer.Option(
            "--memory-budget",
            help=(
                "Bytes of data buffers (batches read and written, their read staging) held at once; at least 1 MiB "
                "(a small budget writes fewer files at once). Pieces larger than a batch are read and written part by "
                "part, so large tensors do not raise the peak (docs/architecture.md). "
                f"Default: reshape()'s DEFAULT_MEMORY_BUDGET, 384 MiB. Sizes: {SIZE_HELP}."
            ),
            show_default=False,
        ),
    ] = None,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Target files written in parallel.")] = 2,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it is a checkpoint.")] = False,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Read DST back and check every CRC.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    storage_options: Annotated[Optional[str], typer.Option("--storage-options", help=STORAGE_OPTIONS_HELP)] = None,
) -> None:
    """Rewrite SRC at DST laid out for another mesh / ZeRO stage (or consolidated), streaming, verified."""
    url_storage_options(storage_options)  # SRC's and DST's, where they are URLs
    # The source's reads start before the imports (~0.5 s with the disk idle otherwise).
    with prefetching(src), small_job_engine(src):
        with startup.imports():
            from reshard import LayoutError
            from ucp.conversion.reshape import DEFAULT_MEMORY_BUDGET, MIN_MEMORY_BUDGET
            from ucp.errors import CheckpointError

        try:
            budget = (
                DEFAULT_MEMORY_BUDGET
                if memory_budget is None
                else parse_size(memory_budget, what="--memory-budget", minimum=MIN_MEMORY_BUDGET)
            )
        except ValueError as exc:
            raise bad_input(str(exc)) from None
        try:
            target = _target_layout(src, tp, pp, dp, zero, layout_file, model)
            source_reads_start()
            with phase("io"):
                report = _run(src, dst, target, budget, workers, overwrite, json_output)
        except (LayoutError, CheckpointError, OSError) as exc:
            raise fail_with(exc, _one_line_keeping_diagram(exc)) from None
        peak_rss = memstat.peak_rss()
        with phase("io"):
            problems = _read_back(dst) if verify else None
        doc = {
            **report.model_dump(mode="json"),
            "peak_rss_bytes": peak_rss,
            "command": command_line(),
            "verified": None if problems is None else not problems,
            "problems": problems,
        }
        if json_output:
            typer.echo(json.dumps(doc, indent=2))
        else:
            what = (
                "consolidated"
                if target is None
                else (f"tp={target.mesh.tp} pp={target.mesh.pp} dp={target.mesh.dp} ZeRO-{target.zero.stage}")
            )
            gbps = report.bytes_written / max(report.seconds, 1e-9) / 1e9
            out.print(
                f"[green]reshaped[/green] {escape(src)} -> {escape(dst)} ({what}): {report.files} files, "
                f"{report.tensors} tensors, {report.bytes_written / 1e9:.3f} GB in {report.seconds:.2f} s "
                f"({gbps:.2f} GB/s), peak RSS {peak_rss / 2**20:.0f} MiB",
                highlight=False,
            )
            if problems is not None:
                out.print("verified: every CRC matches" if not problems else f"[red]{len(problems)} problems[/red]")
            for p in problems or ():
                out.print(f"[red]{p['kind']}[/red]: {escape(p['message'])}", highlight=False, soft_wrap=True)
        if problems:
            raise typer.Exit(EXIT_PROBLEMS)


def _read_back(dst: str) -> list[dict[str, Any]]:
    """Verify what was written (every CRC): its problems as JSON objects, [] when clean. Failing to
    read it back at all is a problem too."""
    import ucp

    try:
        report = ucp.verify(dst)
    except (OSError, ValueError) as exc:  # ucp.CheckpointError is a ValueError
        return [{"kind": type(exc).__name__, "message": one_line(exc)}]
    return [
        {"kind": p.kind, "message": p.message, **{k: getattr(p, k, None) for k in ("file", "tensor", "offset")}}
        for p in report.problems
    ]


def _one_line_keeping_diagram(exc: BaseException) -> str:
    """An error's message; multi-line only for a layout pattern error, whose further lines show the
    pattern with a caret under the part at fault."""
    from reshard import PatternError

    return str(exc) if isinstance(exc, PatternError) else one_line(exc)


def _target_layout(
    src: str,
    tp: int | None,
    pp: int | None,
    dp: int | None,
    zero: int | None,
    layout_file: Path | None,
    model: str | None,
):  # -> reshard.Layout | None
    """The target layout from the options and what SRC recorded; None means consolidate
    (:func:`ucp.conversion.api.target_layout`, which ``ucp.reshape`` uses too; ``--model`` gives its base)."""
    from reshard import LayoutError
    from ucp.conversion.api import target_layout

    if model is None:
        return target_layout(src, tp=tp, pp=pp, dp=dp, zero=zero, layout=layout_file)
    if layout_file is None and tp is None and pp is None and dp is None and zero is None:
        raise LayoutError("--model gives a base layout; say the target with --tp/--pp/--dp/--zero")
    if layout_file is not None:
        return target_layout(src, tp=tp, pp=pp, dp=dp, zero=zero, layout=layout_file)
    from training.layout import gpt_layout
    from training.models.gpt import PRESETS

    if model not in PRESETS:
        raise LayoutError(f"--model {model!r} is not a preset ({', '.join(sorted(PRESETS))})")
    return target_layout(src, tp=tp, pp=pp, dp=dp, zero=zero, layout=gpt_layout(PRESETS[model]))


def _run(src: str, dst: str, target, budget: int, workers: int, overwrite: bool, quiet: bool):
    from ucp.conversion.reshape import reshape

    with progress_bar("reshape (MiB)", enabled=not quiet) as update:
        return reshape(
            src,
            dst,
            layout=target,
            memory_budget=budget,
            workers=workers,
            overwrite=overwrite,
            progress=lambda done, total, what: update(-(-done >> 20), -(-total >> 20), what),
        )


def register(app: typer.Typer) -> None:
    app.command("reshape")(scoped_url_options(reshape_cmd))
