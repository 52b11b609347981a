"""``ucp reshape SRC DST``: rewrite a checkpoint for another TP/PP/DP/ZeRO layout, or consolidate it.

The target is the layout SRC recorded (the training engine records it) with the mesh axes and
ZeRO stage given on the command line changed, or a layout file (``--layout``), or, for a
checkpoint that recorded none (an imported one), the reference GPT preset (``--model``). With no
target at all, the checkpoint is consolidated: one piece per tensor, one file.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import command_line, fail, out, parse_size, prefetching, progress_bar, source_reads_start

EXIT_BAD_INPUT = 2


def reshape_cmd(
    src: Annotated[str, typer.Argument(help="Checkpoint to read (a directory or an fsspec URL).")],
    dst: Annotated[str, typer.Argument(help="Where to write the reshaped checkpoint (must not exist).")],
    tp: Annotated[Optional[int], typer.Option("--tp", min=1, help="Target tensor-parallel size.")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", min=1, help="Target pipeline-parallel size.")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", min=1, help="Target data-parallel size.")] = None,
    zero: Annotated[Optional[int], typer.Option("--zero", min=0, max=3, help="Target ZeRO stage (0-3).")] = None,
    layout_file: Annotated[Optional[Path], typer.Option("--layout", help="A layout JSON file (docs/patterns.md) "
                                                        "as the target; the flags above override its mesh/stage.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Base layout: the reference GPT preset of this name "
                                                 "(for checkpoints that recorded no layout).")] = None,
    memory_budget: Annotated[str, typer.Option("--memory-budget", help="Bytes of data held at once.")] = "512MiB",
    workers: Annotated[int, typer.Option("--workers", min=1, help="Target files written in parallel.")] = 2,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it is a checkpoint.")] = False,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Read DST back and check every CRC.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
) -> None:
    """Rewrite SRC at DST laid out for another mesh / ZeRO stage (or consolidated), streaming, verified."""
    from reshard import LayoutError

    from ucp.errors import CheckpointError

    budget = parse_size(memory_budget, "--memory-budget")
    try:
        target = _target_layout(src, tp, pp, dp, zero, layout_file, model)
        with prefetching(src):
            source_reads_start()
            report = _run(src, dst, target, budget, workers, overwrite, json_output)
    except (LayoutError, CheckpointError, OSError) as exc:
        raise fail(f"{type(exc).__name__}: {exc}", code=EXIT_BAD_INPUT) from None
    peak_rss = _peak_rss()
    problems = None
    if verify:
        import ucp

        problems = ucp.verify(dst).problems
    doc = {**report.model_dump(mode="json"), "peak_rss_bytes": peak_rss, "command": command_line(),
           "verified": None if problems is None else not problems}
    if json_output:
        typer.echo(json.dumps(doc, indent=2))
    else:
        what = "consolidated" if target is None else (
            f"tp={target.mesh.tp} pp={target.mesh.pp} dp={target.mesh.dp} ZeRO-{target.zero.stage}")
        gbps = report.bytes_written / max(report.seconds, 1e-9) / 1e9
        out.print(f"[green]reshaped[/green] {src} -> {dst} ({what}): {report.files} files, {report.tensors} tensors, "
                  f"{report.bytes_written / 1e9:.3f} GB in {report.seconds:.2f} s ({gbps:.2f} GB/s), "
                  f"peak RSS {peak_rss / 2**20:.0f} MiB", highlight=False)
        if problems is not None:
            out.print("verified: every CRC matches" if not problems else f"[red]{len(problems)} problems[/red]")
    if problems:
        for p in problems:
            out.print(f"[red]{p.kind}[/red]: {p.message}", highlight=False)
        raise typer.Exit(1)


def _peak_rss() -> int:
    """This process's peak resident set (bytes): VmHWM, which starts afresh at exec (ru_maxrss does not:
    a child inherits its parent's high-water mark)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _target_layout(src: str, tp: int | None, pp: int | None, dp: int | None, zero: int | None,
                   layout_file: Path | None, model: str | None):  # -> reshard.Layout | None
    """The target layout from the options and what SRC recorded; None means consolidate."""
    from reshard import Layout, LayoutError

    from ucp.placement import recorded_layout
    from ucp.reader import read_checkpoint_manifest

    flags = {k: v for k, v in (("tp", tp), ("pp", pp), ("dp", dp)) if v is not None}
    if layout_file is None and not flags and zero is None:
        if model is not None:
            raise LayoutError("--model gives a base layout; say the target with --tp/--pp/--dp/--zero")
        return None
    if layout_file is not None:
        base = Layout.load(layout_file)
    elif model is not None:
        from training.layout import gpt_layout
        from training.models.gpt import PRESETS

        if model not in PRESETS:
            raise LayoutError(f"--model {model!r} is not a preset ({', '.join(sorted(PRESETS))})")
        base = gpt_layout(PRESETS[model])
    else:
        base = recorded_layout(read_checkpoint_manifest(src), source=f"{src}/manifest.json").layout
        if base is None:
            raise LayoutError(f"{src} records no layout (metadata.layout); give one with --layout FILE "
                              "or --model PRESET")
    mesh = base.mesh.model_copy(update=flags)
    try:
        mesh = type(base.mesh).model_validate(mesh.model_dump())
    except ValueError as exc:
        raise LayoutError(f"target mesh: {exc}") from None
    stage = base.zero.stage if zero is None else zero
    return base.replace(mesh=mesh, zero=base.zero.model_copy(update={"stage": stage}))


def _run(src: str, dst: str, target, budget: int, workers: int, overwrite: bool, quiet: bool):
    from ucp.reshape import reshape

    with progress_bar("reshape", enabled=not quiet) as update:
        return reshape(src, dst, layout=target, memory_budget=budget, workers=workers, overwrite=overwrite,
                       progress=lambda done, total, what: update(done, total, what))


def register(app: typer.Typer) -> None:
    app.command("reshape")(reshape_cmd)
