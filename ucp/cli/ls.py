"""``ucp ls ROOT``: the checkpoints under a CheckpointManager root — step, size, status, which is latest.

"Latest" is what a resume loads (:meth:`ucp.CheckpointManager.latest`): the checkpoint the
``latest`` pointer names if it is complete, else the newest complete one. When the pointer is
missing, unreadable or names a checkpoint that is not complete, a note says so (``notes`` in
``--json``).

ROOT may be an object-store URL (``s3://bucket/run``, with ``--storage-options`` or the AWS
environment variables): there a step prefix without a manifest is ``incomplete`` (a save in flight or
an interrupted one; see docs/object-stores.md).

Exit codes: 0 listed (also when some entries are corrupt: their status says so), 2 ROOT is not
a local directory or object-store prefix (it does not exist, is a file, the store refuses the request)
or is a checkpoint itself rather than a root (``ucp inspect`` shows one checkpoint).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape

from aio.sizes import format_size
from ucp.cli.common import STORAGE_OPTIONS_HELP, bad_input, one_line, out, parse_storage_options

if TYPE_CHECKING:
    from ucp.manager import CheckpointInfo


def resume_latest(
    root: str, infos: list[CheckpointInfo], pointer: tuple[int, str] | None
) -> tuple[CheckpointInfo | None, str | None]:
    """(the entry a resume loads, a note when that is not simply what the pointer names)."""
    from ucp.manager import LATEST, resume_choice

    choice = resume_choice(infos)
    if choice is None or choice.latest:
        if choice is None and infos:
            return None, "no checkpoint is complete: loading finds nothing to resume from"
        return choice, None
    if pointer is not None:
        why = f"'latest' names {pointer[1]}, which is not complete"
    elif "://" not in root and os.path.lexists(os.path.join(root, LATEST)):
        why = "the 'latest' pointer cannot be read"
    else:
        why = "there is no 'latest' pointer"
    return choice, f"{why}; loading falls back to the newest complete checkpoint, {choice.name}"


def ls_cmd(
    root: Annotated[str, typer.Argument(help="A CheckpointManager root (holding step-NNNNNNNN/ directories).")],
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout instead of the table.")
    ] = False,
    storage_options: Annotated[Optional[str], typer.Option("--storage-options", help=STORAGE_OPTIONS_HELP)] = None,
    remote: Annotated[
        Optional[str],
        typer.Option(
            "--remote",
            help="The remote tier of a tiered manager (CheckpointManager(remote=...)): list it too, and say which "
            "local checkpoints are replicated there. --storage-options applies to it.",
        ),
    ] = None,
) -> None:
    """List the checkpoints under ROOT: step, size, status (complete / saving / temp leftovers ...), latest.

    Only [bold]complete[/bold] checkpoints are ever loaded; [bold]temp[/bold] and [bold]old[/bold] entries
    are leftovers of interrupted saves, removed by the next save. ROOT may be an s3:// URL. Exit code 2 when
    ROOT is not a local directory or object-store prefix, or is one checkpoint rather than a root (see ucp inspect).
    """
    options = parse_storage_options(storage_options)
    doc = _tier(root, options)
    replicated: set[int] | None = None
    if remote is not None:
        doc["remote"] = _tier(remote, options)
        replicated = {c.step for c in doc["remote"]["infos"] if c.status == "complete"}
        for c in doc["checkpoints"]:
            c["replicated"] = c["status"] == "complete" and c["step"] in replicated
    if json_output:
        doc.pop("infos")
        if remote is not None:
            doc["remote"].pop("infos")
        typer.echo(json.dumps(doc, indent=2))
        return
    _print_tier(doc, replicated)
    if remote is not None:
        out.print("")
        _print_tier(doc["remote"], None)


def _tier(root: str, options: dict | None) -> dict:
    """One tier's listing: the ``--json`` document (and its entries as ``infos``)."""
    if "://" in root:
        infos, pointer = _list_url(root, options)
    else:
        infos, pointer = _list_local(root)
    latest, note = resume_latest(root, infos, pointer)
    if latest is not None and not latest.latest:
        infos = [i.model_copy(update={"latest": True}) if i is latest else i for i in infos]
    return {
        "root": root,
        "latest": latest.step if latest else None,
        "latest_pointer": {"step": pointer[0], "name": pointer[1]} if pointer else None,
        "notes": [note] if note else [],
        "checkpoints": [i.model_dump(mode="json") for i in infos],
        "infos": infos,
    }


def _print_tier(doc: dict, replicated: set[int] | None) -> None:
    from rich.table import Table

    root, infos, note = doc["root"], doc["infos"], (doc["notes"] or [None])[0]
    if not infos:
        out.print(f"no checkpoints under {escape(root)}", highlight=False)
        return
    styles = {
        "complete": "green",
        "saving": "cyan",
        "temp": "yellow",
        "old": "dim",
        "incomplete": "red",
        "corrupt": "bold red",
    }
    table = Table(title=escape(root), title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("name")
    table.add_column("size", justify="right")
    table.add_column("status")
    table.add_column("created (UTC)")
    table.add_column("latest")
    if replicated is not None:
        table.add_column("replicated")
    for i in infos:
        status = f"[{styles[i.status]}]{i.status}[/]"
        created = i.created.strftime("%Y-%m-%d %H:%M:%S") if i.created else ""
        mark = "← latest" if i.latest else ""
        row = [str(i.step), escape(i.name), format_size(i.size), status, created, mark]
        if replicated is not None:
            row.append("yes" if i.status == "complete" and i.step in replicated else "[yellow]no[/]")
        table.add_row(*row)
    out.print(table)
    if note:
        out.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)
    problems = [i for i in infos if i.detail and i.status in ("corrupt", "incomplete")]
    for i in problems:
        out.print(f"[red]{escape(i.name)}[/red]: {escape(i.detail or '')}", highlight=False)


def _list_url(root: str, options: dict | None) -> tuple[list[CheckpointInfo], tuple[int, str] | None]:
    """An object-store root's entries and pointer; exit 2 naming the URL when the store refuses."""
    from ucp.errors import CheckpointError
    from ucp.format.manifest import MANIFEST_NAME
    from ucp.manager_remote import list_checkpoints, open_root, read_latest

    try:
        with open_root(root, options) as storage:
            if storage.exists(MANIFEST_NAME):
                raise bad_input(
                    f"{root} is a checkpoint, not a CheckpointManager root (the prefix holding step-NNNNNNNN/ "
                    f"checkpoints); 'ucp inspect {root}' shows what it holds"
                )
            try:
                storage.listdir("")
            except FileNotFoundError:
                raise bad_input(f"{root} does not exist (nothing is stored under it)") from None
            return list_checkpoints(storage), read_latest(storage)
    except (CheckpointError, OSError) as exc:
        raise bad_input(f"{root}: cannot list it: {one_line(exc)}") from None


def _list_local(root: str) -> tuple[list[CheckpointInfo], tuple[int, str] | None]:
    from ucp.format.manifest import MANIFEST_NAME
    from ucp.manager import list_checkpoints, read_latest

    if not os.path.exists(root):
        raise bad_input(f"{root} does not exist")
    if not os.path.isdir(root):
        raise bad_input(f"{root} is not a directory")
    if os.path.isfile(os.path.join(root, MANIFEST_NAME)):
        raise bad_input(
            f"{root} is a checkpoint, not a CheckpointManager root (the folder holding step-NNNNNNNN/ checkpoints); "
            f"'ucp inspect {root}' shows what it holds"
        )
    try:
        return list_checkpoints(root), read_latest(root)
    except OSError as exc:  # e.g. no permission to list it
        raise bad_input(f"{root}: cannot list it: {exc.strerror or exc}") from None


def register(app: typer.Typer) -> None:
    app.command("ls")(ls_cmd)
