"""``ucp bench ...``: throughput measurements, one ``@bench_app.command`` each:
``ucp bench io`` (storage I/O) and ``ucp bench save`` (checkpoint save/load)."""

from __future__ import annotations

import json
import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from aio.sizes import SIZE_HELP
from ucp.bench.common import MAX_SIZE_GIB
from ucp.cli.common import (
    command_line,
    err,
    fail_with,
    load_aio_config,
    out,
    progress_bar,
    require_dir,
    split_csv,
)

bench_app = typer.Typer(
    help="Measure storage and checkpoint throughput on this machine.",
    rich_markup_mode="rich",
    no_args_is_help=True,
)


class RawChoice(str, Enum):
    auto = "auto"
    fio = "fio"
    dd = "dd"
    none = "none"


@bench_app.command("io")
def bench_io(
    size_gib: Annotated[
        float,
        typer.Option("--size-gib", min=0.001, max=MAX_SIZE_GIB, help="GiB written and read per method per round."),
    ] = 2.0,
    rounds: Annotated[
        int, typer.Option("--rounds", min=1, help="Rounds; every method runs once per round, medians reported.")
    ] = 3,
    directory: Annotated[
        Optional[Path],
        typer.Option(
            "--dir",
            help="Directory on the disk to measure (must exist). Default: a temp dir under the current directory.",
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout instead of the table.")
    ] = False,
    raw: Annotated[
        RawChoice, typer.Option("--raw", help="Device-limit tool: fio if installed (auto), the dd fallback, or none.")
    ] = RawChoice.auto,
    methods: Annotated[
        Optional[str],
        typer.Option("--methods", help="Comma list of: raw, libaio, threads, torch, safetensors (default all)."),
    ] = None,
    aio_config: Annotated[
        Optional[Path],
        typer.Option("--aio-config", help="JSON aio config (e.g. `ucp tune --output` or a DeepSpeed config)."),
    ] = None,
    block_size: Annotated[
        Optional[str], typer.Option("--block-size", help=f"Override the aio block size, e.g. 8MiB ({SIZE_HELP}).")
    ] = None,
    queue_depth: Annotated[
        Optional[int], typer.Option("--queue-depth", min=1, help="Override the aio queue depth.")
    ] = None,
    threads: Annotated[
        Optional[int], typer.Option("--threads", min=1, help="Override the threads engine's thread count.")
    ] = None,
    fio_iomem: Annotated[
        str,
        typer.Option(
            "--fio-iomem",
            help="fio's buffer memory (--iomem): malloc, or shmhuge once huge pages are reserved "
            "(echo N > /proc/sys/vm/nr_hugepages), so that fio's requests are not split by scattered 4 KiB pages.",
        ),
    ] = "malloc",
    drop_caches: Annotated[
        bool,
        typer.Option(
            "--drop-caches/--no-drop-caches",
            help="Drop the whole system's page cache before every read (needs root; every process on the machine "
            "then reads from disk again). Off by default: the bench evicts only its own files.",
        ),
    ] = False,
) -> None:
    """Write then read N GiB with fio/dd, UCP's aio engines, torch.save/load and safetensors.

    Methods run interleaved round by round; reads are cold; the data read back is checked.
    """
    from aio.sizes import parse_size
    from ucp.bench.io import METHOD_CHOICES, BenchIoOptions, run_bench_io

    require_dir(directory, "--dir")
    cfg = load_aio_config(aio_config)
    overrides: dict[str, object] = {}
    try:
        if block_size is not None:
            overrides["block_size"] = parse_size(block_size, what="--block-size")
        if queue_depth is not None:
            overrides["queue_depth"] = queue_depth
        if threads is not None:
            overrides["thread_count"] = threads
        cfg = cfg.model_validate({**cfg.model_dump(), **overrides})
        options = BenchIoOptions(
            size_gib=size_gib,
            rounds=rounds,
            directory=directory,
            raw=raw.value,
            methods=split_csv(methods) or list(METHOD_CHOICES),
            aio=cfg,
            drop_caches=drop_caches,
            fio_iomem=fio_iomem,
        )
    except ValueError as exc:
        raise fail_with(exc) from exc

    _run_and_report("bench io", run_bench_io, options, json_output=json_output, rounds=rounds)


@bench_app.command("save")
def bench_save(
    size_gib: Annotated[
        float,
        typer.Option(
            "--size-gib",
            min=0.001,
            max=MAX_SIZE_GIB,
            help="Training state size in GiB (bf16 weights + fp32 master + Adam).",
        ),
    ] = 2.0,
    rounds: Annotated[
        int, typer.Option("--rounds", min=1, help="Rounds; every method runs once per round, medians reported.")
    ] = 3,
    ranks: Annotated[
        str, typer.Option("--ranks", help="Comma list of world sizes, each run as real processes (gloo).")
    ] = "1,2",
    directory: Annotated[
        Optional[Path],
        typer.Option(
            "--dir",
            help="Directory on the disk to measure (must exist). Default: a temp dir under the current directory.",
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout instead of the table.")
    ] = False,
    methods: Annotated[
        Optional[str],
        typer.Option(
            "--methods", help="Comma list of: raw, ucp, torch, safetensors, dcp, ucp-dcp, async (default all)."
        ),
    ] = None,
    raw: Annotated[
        RawChoice, typer.Option("--raw", help="Device-limit tool: fio if installed (auto), the dd fallback, or none.")
    ] = RawChoice.auto,
    fio_iomem: Annotated[
        str, typer.Option("--fio-iomem", help="fio's buffer memory (--iomem), e.g. shmhuge; see `ucp bench io --help`.")
    ] = "malloc",
    aio_config: Annotated[
        Optional[Path],
        typer.Option(
            "--aio-config", help="JSON aio config for UCP (e.g. `ucp tune --output`); also fio's block size and depth."
        ),
    ] = None,
    drop_caches: Annotated[
        bool,
        typer.Option(
            "--drop-caches/--no-drop-caches",
            help="Drop the whole system's page cache before every load (needs root; every process on the machine "
            "then reads from disk again). Off by default: the bench evicts only its own files.",
        ),
    ] = False,
    async_snapshot: Annotated[
        str,
        typer.Option(
            "--async-snapshot",
            help="Comma list of AsyncSaver snapshot modes to time: sync (copy, then "
            "return), background (copy while the next step computes), cow "
            "(write-protect, copy from a helper process; the default).",
        ),
    ] = "sync,background,cow",
    async_compute_s: Annotated[
        float,
        typer.Option(
            "--async-compute-s",
            min=0.0,
            help="Simulated forward/backward (s of CPU work) between "
            "async_save and the wait before the next optimizer step.",
        ),
    ] = 1.0,
) -> None:
    """Save and load a GPT-like training state with UCP, torch.save, safetensors and DCP, at 1 and N ranks.

    Also times ucp.async_save's stall and runs fio (the device limit), interleaved round by round; loads are cold and bit-exact checked.
    """
    require_dir(directory, "--dir")
    from ucp.bench.save import METHOD_CHOICES, BenchSaveOptions, run_bench_save

    try:
        world_sizes = [int(x) for x in split_csv(ranks) or []]
        options = BenchSaveOptions(
            size_gib=size_gib,
            rounds=rounds,
            ranks=world_sizes,
            directory=directory,
            methods=split_csv(methods) or list(METHOD_CHOICES),
            raw=raw.value,
            fio_iomem=fio_iomem,
            aio=load_aio_config(aio_config),
            drop_caches=drop_caches,
            async_snapshots=split_csv(async_snapshot) or [],
            async_compute_s=async_compute_s,
        )
    except ValueError as exc:
        raise fail_with(exc) from exc

    _run_and_report("bench save", run_bench_save, options, json_output=json_output, rounds=rounds)


def _run_and_report(title: str, run: Any, options: Any, *, json_output: bool, rounds: int) -> None:
    """Run a benchmark under a progress bar; print its JSON or its report's table (errors exit 1 with one line).

    The JSON is the bench's detailed result with its report (ucp.bench.report.BenchReport) under ``report``."""
    from ucp.bench.common import BenchError, BenchWarning
    from ucp.bench.raw import RawToolError
    from ucp.bench.report import print_table

    show_warning = warnings.showwarning

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, BenchWarning):
            err.print(f"[yellow]warning:[/yellow] {escape(str(message))}", highlight=False, soft_wrap=True)
        else:
            show_warning(message, category, *args, **kwargs)

    try:
        with warnings.catch_warnings(), progress_bar(title) as update:
            warnings.simplefilter("always", BenchWarning)
            warnings.showwarning = show  # restored by catch_warnings
            result = run(options, command=command_line(), progress=update)
    except (BenchError, RawToolError, OSError, ValueError) as exc:
        raise fail_with(exc) from exc
    if json_output:
        doc = {**result.model_dump(mode="json"), "report": result.report().model_dump(mode="json")}
        typer.echo(json.dumps(doc, indent=2))
    else:
        print_table(result.report(), out)
        if rounds < 3:
            err.print("[yellow]note:[/yellow] fewer than 3 rounds; medians are not robust")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
