"""``ucp tune``: search block size x queue depth x threads (x engine) for this disk."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from aio.sizes import SIZE_HELP
from ucp.bench.common import MAX_SIZE_GIB
from ucp.cli.common import EXIT_BAD_INPUT, fail, fail_with, load_aio_config, out, progress_bar, require_dir, split_csv


def tune(
    directory: Annotated[
        Optional[Path],
        typer.Option(
            "--dir",
            help="Directory on the disk to tune for (must exist). Default: a temp dir under the current directory.",
        ),
    ] = None,
    size_gib: Annotated[
        float,
        typer.Option(
            "--size-gib", min=0.0001, help=f"GiB written and read per candidate (at most {MAX_SIZE_GIB:.0f})."
        ),
    ] = 1.0,
    quick: Annotated[
        bool, typer.Option("--quick", help="A smaller grid: block 1M/8M, queue depth 8/32, 4 threads.")
    ] = False,
    engines: Annotated[Optional[str], typer.Option("--engines", help="Comma list: libaio, threads.")] = None,
    block_sizes: Annotated[
        Optional[str], typer.Option("--block-sizes", help=f"Comma list, e.g. 1MiB,4MiB,8MiB,16MiB ({SIZE_HELP}).")
    ] = None,
    queue_depths: Annotated[Optional[str], typer.Option("--queue-depths", help="Comma list, e.g. 8,32.")] = None,
    thread_counts: Annotated[
        Optional[str], typer.Option("--threads", help="Comma list for the threads engine, e.g. 4,8.")
    ] = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Measurements per candidate (median).")] = 1,
    base_config: Annotated[
        Optional[Path],
        typer.Option("--aio-config", help="JSON aio config whose other fields (alignment, use_direct...) are kept."),
    ] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Also write the best config (JSON) to this file.")
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object: the best config and every trial.")
    ] = False,
) -> None:
    """Find the fastest aio configuration for a directory; print it as UCP and DeepSpeed config.

    Every candidate writes the file (fsync included) and reads it back cold; the least
    total time wins. The output's [bold]deepspeed.aio[/bold] section drops into a DeepSpeed config.
    """
    from aio.config import GIB
    from aio.sizes import parse_size
    from aio.tune import TuneGrid, run_tune

    if not 0 < size_gib <= MAX_SIZE_GIB:  # also refuses nan
        raise fail(f"--size-gib must be a number of GiB up to {MAX_SIZE_GIB:.0f}, got {size_gib}", EXIT_BAD_INPUT)
    require_dir(directory, "--dir")
    if output is not None:
        _check_writable(output)
    base = load_aio_config(base_config)
    try:
        size = max(4096, round(size_gib * GIB) // 4096 * 4096)
        grid = TuneGrid.quick() if quick else TuneGrid()
        update: dict[str, object] = {}
        if engines:
            update["engines"] = split_csv(engines)
        if block_sizes:
            update["block_sizes"] = [parse_size(s, what="--block-sizes") for s in split_csv(block_sizes) or []]
        if queue_depths:
            update["queue_depths"] = [int(s) for s in split_csv(queue_depths) or []]
        if thread_counts:
            update["thread_counts"] = [int(s) for s in split_csv(thread_counts) or []]
        grid = TuneGrid.model_validate({**grid.model_dump(), **update})
        total = len(grid.plan(size, base)) * repeats  # also validates every candidate; none is an error
    except ValueError as exc:
        raise fail_with(exc) from exc

    try:
        with progress_bar("tune") as bar:
            done = [0]

            def step(what: str) -> None:
                bar(done[0], total, what)
                done[0] += 1

            result = run_tune(directory, size=size, grid=grid, repeats=repeats, base=base, progress=step)
    except (OSError, RuntimeError, ValueError) as exc:
        raise fail_with(exc) from exc

    best = result.config_sections()
    if output is not None:
        try:
            output.write_text(json.dumps(best, indent=2) + "\n")
        except OSError as exc:
            raise fail(f"cannot write --output {output}: {exc.strerror or exc}") from exc
    if json_output:
        typer.echo(json.dumps({**best, "tune": result.model_dump(mode="json")}, indent=2))
        return
    _print_trials(result)
    out.print_json(json.dumps(best))


def _check_writable(output: Path) -> None:
    """Refuse an --output that cannot be written before the search, not after it."""
    parent = output.parent
    if output.is_dir():
        raise fail(f"cannot write --output {output}: it is a directory", EXIT_BAD_INPUT)
    if not parent.is_dir():
        raise fail(f"cannot write --output {output}: {parent} is not a directory", EXIT_BAD_INPUT)
    if not os.access(output if output.exists() else parent, os.W_OK):
        raise fail(f"cannot write --output {output}: permission denied", EXIT_BAD_INPUT)


def _print_trials(result) -> None:  # result: aio.tune.TuneResult
    from rich.table import Table

    from aio.sizes import format_size
    from aio.tune import describe

    table = Table(title=f"ucp tune: {result.size_bytes / 2**30:g} GiB on {result.directory}", title_justify="left")
    for col in ("rank", "config", "write GB/s", "read GB/s", "write+read s"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for i, t in enumerate(result.trials, 1):
        table.add_row(str(i), describe(t.config), f"{t.write_gbps:.2f}", f"{t.read_gbps:.2f}", f"{t.seconds:.2f}")
    out.print(table)
    if not result.cold_reads:
        out.print(f"[yellow]reads may be warm:[/yellow] {result.cold_note}")
    if not result.direct_io:
        out.print("[yellow]O_DIRECT refused here; buffered I/O was measured[/yellow]")
    for engine, why in result.skipped_engines.items():
        out.print(f"[yellow]skipped {engine}:[/yellow] {why}")
    if result.collapsed_block_sizes:
        sizes = ", ".join(format_size(b) for b in result.collapsed_block_sizes)
        out.print(
            f"[yellow]block sizes {sizes} exceed the {format_size(result.size_bytes)} test file:[/yellow] "
            "one request moves it all, so they were measured once, as the largest block that fits"
        )
    out.print(f"best write: {describe(result.best_write)}; best read: {describe(result.best_read)}")
    out.print("[bold]best overall:[/bold]")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
