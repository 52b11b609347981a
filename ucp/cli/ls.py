"""``ucp ls ROOT``: the checkpoints under a CheckpointManager root — step, size, status, which is latest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .common import fail, out


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def ls_cmd(
    root: Annotated[Path, typer.Argument(help="A CheckpointManager root (holding step-NNNNNNNN/ directories).")],
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of the table.")] = False,
) -> None:
    """List the checkpoints under ROOT: step, size, status (complete / saving / temp leftovers ...), latest.

    Only [bold]complete[/bold] checkpoints are ever loaded; [bold]temp[/bold] and [bold]old[/bold] entries
    are leftovers of interrupted saves, removed by the next save.
    """
    from rich.table import Table

    from ucp.manager import list_checkpoints, read_latest

    if not root.is_dir():
        raise fail(f"{root} is not a directory")
    infos = list_checkpoints(root)
    pointer = read_latest(root)
    latest = next((i for i in infos if i.latest), None)
    if json_output:
        doc = {
            "root": str(root),
            "latest": latest.step if latest else None,
            "latest_pointer": {"step": pointer[0], "name": pointer[1]} if pointer else None,
            "checkpoints": [i.model_dump(mode="json") for i in infos],
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    if not infos:
        out.print(f"no checkpoints under {root}")
        return
    styles = {"complete": "green", "saving": "cyan", "temp": "yellow", "old": "dim", "incomplete": "red",
              "corrupt": "bold red"}
    table = Table(title=str(root), title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("name")
    table.add_column("size", justify="right")
    table.add_column("status")
    table.add_column("created (UTC)")
    table.add_column("latest")
    for i in infos:
        status = f"[{styles[i.status]}]{i.status}[/]"
        created = i.created.strftime("%Y-%m-%d %H:%M:%S") if i.created else ""
        table.add_row(str(i.step), i.name, human_size(i.size), status, created, "← latest" if i.latest else "")
    out.print(table)
    if pointer is not None and latest is None:
        out.print(f"[yellow]note:[/yellow] 'latest' names {pointer[1]}, which is not complete; "
                  "loading falls back to the newest complete checkpoint")
    problems = [i for i in infos if i.detail and i.status in ("corrupt", "incomplete")]
    for i in problems:
        out.print(f"[red]{i.name}[/red]: {i.detail}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("ls")(ls_cmd)
