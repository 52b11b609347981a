"""``ucp demo``: the end-to-end demonstration (training.demo) — train on 4 processes with async
checkpoints, crash, resume on 2 processes in another layout, reshape, export, the optimizer state on
NVMe (save, resume), summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ucp.cli.common import err, fail, fail_with, out


def demo_cmd(
    workdir: Annotated[
        Optional[Path],
        typer.Option("--workdir", help="Where everything goes (default: a new temporary directory, kept)."),
    ] = None,
    model: Annotated[str, typer.Option("--model", help="Reference GPT preset.")] = "small",
    steps: Annotated[int, typer.Option("--steps", min=4, help="Steps of the whole run.")] = 16,
    kill_at: Annotated[int, typer.Option("--kill-at", min=1, help="The crash comes right after this step.")] = 10,
    save_every: Annotated[int, typer.Option("--save-every", min=1, help="Checkpoint every N steps.")] = 3,
    json_output: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
) -> None:
    """Train, crash, resume elsewhere, reshape, export, offload to NVMe — UCP end to end on this machine (CPU)."""
    from training.demo import DemoConfig, run_demo

    if kill_at >= steps - 1:
        raise fail(f"--kill-at {kill_at} must come before the last steps (--steps {steps})", code=2)
    cfg = DemoConfig(workdir=workdir, model=model, total_steps=steps, kill_at=kill_at, save_every=save_every)
    console = err if json_output else out
    say = lambda text: console.print(text, highlight=False, soft_wrap=True)  # noqa: E731
    try:
        summary = run_demo(cfg, say)
    except (RuntimeError, TimeoutError, FileExistsError) as exc:
        raise fail_with(exc) from None
    if json_output:
        typer.echo(json.dumps(summary.model_dump(mode="json"), indent=2))
        return
    _print_summary(summary)


def _print_summary(s) -> None:  # s: training.demo.DemoSummary
    """The summary table; every time in seconds, steps numbered as the training log numbers them."""
    from rich.table import Table

    f, c, r, k = s.first_run, s.crash, s.resume, s.continuity
    gib = c["checkpoint_bytes"] / 2**30
    t = Table(title="UCP demo — summary", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row(
        "first run",
        f"{f['processes']} processes, tp={f['layout']['tp']} dp={f['layout']['dp']} "
        f"ZeRO-{f['layout']['zero']}; steps 0–{f['steps_done'] - 1}, median {f['median_step_s']:.2f} s per step",
    )
    if f["median_save_stall_s"] is not None:
        t.add_row(
            "async save stall",
            f"median {f['median_save_stall_s']:.3f} s per checkpoint "
            f"({f['median_save_stall_s'] / f['median_step_s'] * 100:.1f}% of a step)",
        )
    if f["median_after_checkpoint_step_s"] is not None and f["median_other_step_s"] is not None:
        steps = ", ".join(str(st) for st in f["after_checkpoint_steps"])
        t.add_row(
            "steps after a checkpoint",
            f"median {f['median_after_checkpoint_step_s']:.2f} s (steps {steps}: the copy and write run beside them) "
            f"vs {f['median_other_step_s']:.2f} s for the other steps",
        )
    leftovers = [e["name"] for e in c["listing"] if e["status"] != "complete"]
    t.add_row(
        "crash",
        f"SIGKILL after step {c['after_step']}; latest complete checkpoint: step "
        f"{c['latest_complete']} ({gib:.2f} GiB)"
        + (f"; leftover of the killed save (never loaded): {', '.join(leftovers)}" if leftovers else ""),
    )
    t.add_row(
        "resume",
        f"{r['processes']} processes, tp={r['layout']['tp']} dp={r['layout']['dp']} "
        f"ZeRO-{r['layout']['zero']}; loaded step {r['resumed_at']} in {r['load_s']:.2f} s "
        f"({r['load_gb_per_s']:.2f} GB/s incl. resharding)",
    )
    t.add_row(
        "loss continuity",
        ", ".join(f"step {st}: {a:.6f} → {b:.6f}" for st, a, b in zip(k["steps"], k["before"], k["after"]))
        + f"  (max rel. diff {k['max_relative_difference']:.1e})",
    )
    t.add_row("last step", f"step {r['last_step']}, loss {r['final_loss']:.6f}")
    rs = s.reshape
    t.add_row(
        "ucp reshape",
        f"consolidated {rs['files']} file, {rs['bytes_written'] / 1e9:.3f} GB in "
        f"{rs['seconds']:.2f} s ({rs['bytes_written'] / max(rs['seconds'], 1e-9) / 1e9:.2f} GB/s)",
    )
    ex = s.export
    t.add_row(
        "ucp export",
        f"Hugging Face safetensors (bf16), {ex.get('tensors')} tensors, "
        f"{ex.get('bytes', 0) / 1e6:.1f} MB in {ex.get('seconds', 0):.2f} s → {ex.get('dst')}",
    )
    o = s.offload
    t.add_row(
        "optimizer on NVMe",
        f"{o['processes']} processes, tp={o['layout']['tp']} dp={o['layout']['dp']} ZeRO-{o['layout']['zero']}: "
        f"{o['state_bytes_per_rank'] / 1e6:.0f} MB of masters and moments per rank in swap files through a "
        f"{o['pool_bytes'] / 1e6:.0f} MB pool; peak RSS {o['peak_rss'] / 1e6:.0f} MB (rank 0); "
        f"median {o['median_step_s']:.2f} s per step",
    )
    rate = lambda v: f"{v:.2f} GB/s" if v is not None else "–"  # noqa: E731
    t.add_row(
        "swap traffic",
        f"rank 0, steps {o['steps'][0]}–{o['steps'][-1]}: {o['swap_bytes_read'] / 1e9:.2f} GB read at "
        f"{rate(o['swap_read_gb_per_s'])}, {o['swap_bytes_written'] / 1e9:.2f} GB written at "
        f"{rate(o['swap_write_gb_per_s'])} (while its I/O threads were busy)",
    )
    streamed = o["checkpoint_tier_read"]
    t.add_row(
        "offloaded checkpoint",
        f"saved at step {o['resumed_at']} in {o['save_s']:.2f} s"
        + (f", streamed from the swap files ({streamed / 1e6:.0f} MB read)" if streamed is not None else "")
        + f"; resumed in {o['load_s']:.2f} s; losses equal the first run's (max rel. diff "
        f"{o['max_relative_difference']:.1e}); {o['seconds']:.0f} s for the leg",
    )
    t.add_row("files", f"{s.workdir}  (checkpoints/, consolidated/, hf/, offload-checkpoints/)")
    t.add_row("total", f"{s.seconds:.0f} s")
    out.print()
    out.print(t)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
