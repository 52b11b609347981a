"""``ucp inspect PATH``: what a checkpoint holds, read from its manifest alone (no data is read).

Shows every tensor (dtype, global shape, where its pieces lie), the data files,
the saving job's topology, step, creator and format version, the non-tensor part
of the state dict and the user metadata. ``--json`` prints the same as one
:class:`InspectReport`. Works for local paths and fsspec URLs (``s3://...``).

``--tensor NAME`` shows just that tensor (or the tensors a glob matches): its row, nothing else.

Exit codes (:func:`ucp.cli.common.exit_code`, as for every command): 0 shown (also when
``--tensor`` matches no tensor: a note says so on stderr), 1 the manifest is damaged (invalid
JSON, inconsistent) or the storage failed, 2 the path does not exist or is not a checkpoint,
or an option is invalid.
"""

from __future__ import annotations

import fnmatch
import json
import math
from typing import Annotated, Any, Optional

import typer
from pydantic import BaseModel, Field
from rich.markup import escape

from aio.sizes import format_size
from ucp.cli.common import STORAGE_OPTIONS_HELP, err, fail_with, out, parse_storage_options, unreadable_message
from ucp.cli.common import bad_input as bad_input  # noqa: F401 - where `ucp infer` imports it from


class PieceInfo(BaseModel):
    """Where one piece of a tensor lies: a box (N-d sub-array) or a flat element range, in one file."""

    file: str
    offset: int = Field(description="absolute byte offset in the file")
    length: int = Field(description="bytes")
    box_offsets: list[int] | None = None
    box_shape: list[int] | None = None
    flat_start: int | None = None
    flat_stop: int | None = None
    crc32c: int

    def placement(self) -> str:
        """``[0:2, 0:4]`` for a box, ``flat[16:32)`` for a flat range."""
        if self.box_offsets is not None and self.box_shape is not None:
            dims = ", ".join(f"{o}:{o + s}" for o, s in zip(self.box_offsets, self.box_shape))
            return f"[{dims}]"
        return f"flat[{self.flat_start}:{self.flat_stop})"


class TensorInfo(BaseModel):
    name: str
    dtype: str
    shape: list[int]
    numel: int
    bytes: int
    pieces: list[PieceInfo]


class FileSummary(BaseModel):
    name: str
    rank: int
    size: int = Field(description="bytes, as the manifest records them")
    pieces: int
    tensor_bytes: int = Field(description="bytes of tensor data (size minus the safetensors header)")


class StateValue(BaseModel):
    """A non-tensor value of the saved state dict; lists of plain values are one entry."""

    path: str = Field(description="key path joined with '.', list items as [i]")
    type: str
    value: Any


class InspectReport(BaseModel):
    path: str
    format_version: int
    creator: str
    created: str
    step: int | None
    world_size: int
    mesh: dict[str, int] | None
    tensor_count: int
    piece_count: int
    tensor_bytes: int = Field(description="sum of the logical tensors' sizes")
    file_bytes: int = Field(description="sum of the data files' sizes (headers included)")
    dtypes: dict[str, int] = Field(description="dtype -> bytes of tensors of that dtype")
    files: list[FileSummary]
    tensors: list[TensorInfo]
    state: list[StateValue]
    metadata: dict[str, Any]


def _piece_info(p: Any) -> PieceInfo:
    info = PieceInfo(file=p.file, offset=p.offset, length=p.length, crc32c=p.crc32c)
    if p.box is not None:
        info.box_offsets, info.box_shape = list(p.box.offsets), list(p.box.shape)
    else:
        info.flat_start, info.flat_stop = p.flat.start, p.flat.stop
    return info


def _plain(node: Any) -> Any:
    """A state-tree node without tensors as a JSON value (tags resolved; non-finite floats as strings)."""
    from ucp.format.tree import dict_items, node_kind

    kind = node_kind(node)
    if kind == "scalar":
        return node
    if kind == "list":
        return [_plain(v) for v in node]
    if kind == "tuple":
        return [_plain(v) for v in node["tuple"]]
    if kind == "float":
        return node["float"]
    return {str(k): _plain(v) for k, v in dict_items(node)}


def _is_plain_sequence(node: Any) -> bool:
    from ucp.format.tree import node_kind

    kind = node_kind(node)
    items = node if kind == "list" else node["tuple"] if kind == "tuple" else None
    return items is not None and all(node_kind(v) in ("scalar", "float") for v in items)


def state_values(node: Any, path: str = "") -> list[StateValue]:
    """Every non-tensor leaf of a manifest's state tree, in order."""
    from ucp.format.tree import dict_items, node_kind

    kind = node_kind(node)
    if kind == "tensor":
        return []
    if kind in ("dict", "items"):
        found: list[StateValue] = []
        for k, v in dict_items(node):
            found += state_values(v, f"{path}.{k}" if path else str(k))
        return found
    if kind in ("list", "tuple"):
        items = node if kind == "list" else node["tuple"]
        if _is_plain_sequence(node):
            return [StateValue(path=path, type=f"{kind}[{len(items)}]", value=_plain(node))]
        found = []
        for i, v in enumerate(items):
            found += state_values(v, f"{path}[{i}]")
        return found
    if kind == "float":
        return [StateValue(path=path, type="float", value=node["float"])]
    return [StateValue(path=path, type=type(node).__name__ if node is not None else "None", value=node)]


def build_report(path: str, manifest: Any) -> InspectReport:
    """An :class:`InspectReport` from a checked ``ucp.Manifest``."""
    from ucp.format.dtypes import itemsize

    tensors: list[TensorInfo] = []
    dtypes: dict[str, int] = {}
    per_file: dict[str, list[int]] = {name: [0, 0] for name in manifest.files}  # pieces, bytes
    for name, t in manifest.tensors.items():
        nbytes = math.prod(t.shape) * itemsize(t.dtype)
        dtypes[t.dtype] = dtypes.get(t.dtype, 0) + nbytes
        tensors.append(
            TensorInfo(
                name=name,
                dtype=t.dtype,
                shape=list(t.shape),
                numel=math.prod(t.shape),
                bytes=nbytes,
                pieces=[_piece_info(p) for p in t.pieces],
            )
        )
        for p in t.pieces:
            per_file[p.file][0] += 1
            per_file[p.file][1] += p.length
    files = [
        FileSummary(name=n, rank=f.rank, size=f.size, pieces=per_file[n][0], tensor_bytes=per_file[n][1])
        for n, f in manifest.files.items()
    ]
    return InspectReport(
        path=path,
        format_version=manifest.format_version,
        creator=manifest.creator,
        created=manifest.created.isoformat().replace("+00:00", "Z"),
        step=manifest.step,
        world_size=manifest.topology.world_size,
        mesh=manifest.topology.mesh,
        tensor_count=len(tensors),
        piece_count=sum(len(t.pieces) for t in tensors),
        tensor_bytes=sum(t.bytes for t in tensors),
        file_bytes=sum(f.size for f in files),
        dtypes=dict(sorted(dtypes.items(), key=lambda kv: -kv[1])),
        files=files,
        tensors=tensors,
        state=state_values(manifest.state),
        metadata=manifest.metadata,
    )


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _print_tensors(report: InspectReport, *, max_pieces: int) -> None:
    """The tensors table: name, dtype, shape, pieces and where they lie."""
    from rich.table import Table

    table = Table(title="tensors", title_justify="left")
    for col in ("name", "dtype", "shape", "pieces", "placement (file: box / flat range)", "bytes"):
        table.add_column(col, justify="right" if col in ("pieces", "bytes") else "left", overflow="fold")
    for t in report.tensors:
        shown = [f"{p.file}: {p.placement()}" for p in t.pieces[:max_pieces]]
        if len(t.pieces) > max_pieces:
            shown.append(f"… (+{len(t.pieces) - max_pieces} more)")
        table.add_row(
            escape(t.name), t.dtype, str(t.shape), str(len(t.pieces)), escape("\n".join(shown)), format_size(t.bytes)
        )
    out.print(table)


def _print_report(report: InspectReport, *, max_pieces: int) -> None:
    from rich.table import Table

    mesh = "" if not report.mesh else " (mesh " + " x ".join(f"{k}={v}" for k, v in report.mesh.items()) + ")"
    out.print(f"[bold]{escape(report.path)}[/bold]", highlight=False)
    out.print(
        f"format version {report.format_version}, created {report.created} by {report.creator}, "
        f"step {report.step if report.step is not None else '-'}, world size {report.world_size}{mesh}",
        highlight=False,
    )
    dtype_text = ", ".join(f"{d} {format_size(b)}" for d, b in report.dtypes.items()) or "none"
    out.print(
        f"{report.tensor_count} tensors in {report.piece_count} pieces, {format_size(report.tensor_bytes)} "
        f"({dtype_text}); {len(report.files)} data files, {format_size(report.file_bytes)}",
        highlight=False,
    )

    _print_tensors(report, max_pieces=max_pieces)

    files = Table(title="data files", title_justify="left")
    for col in ("file", "rank", "size", "pieces", "tensor bytes"):
        files.add_column(col, justify="left" if col == "file" else "right")
    for f in report.files:
        files.add_row(escape(f.name), str(f.rank), format_size(f.size), str(f.pieces), format_size(f.tensor_bytes))
    out.print(files)

    if report.state:
        state = Table(title="non-tensor state", title_justify="left")
        for col in ("key", "type", "value"):
            state.add_column(col, overflow="fold")
        for v in report.state:
            state.add_row(escape(v.path), v.type, escape(_short(v.value)))
        out.print(state)
    metadata = json.dumps(report.metadata, ensure_ascii=False) if report.metadata else "none"
    out.print("metadata: " + escape(metadata), highlight=False)


def inspect_cmd(
    path: Annotated[str, typer.Argument(help="Checkpoint directory or fsspec URL (s3://bucket/run/step-100).")],
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    tensor: Annotated[
        Optional[str],
        typer.Option(
            "--tensor", "-t", help="Show just this tensor (or those a glob matches, e.g. 'model.*'): its row alone."
        ),
    ] = None,
    max_pieces: Annotated[
        int, typer.Option("--max-pieces", min=1, help="Placements shown per tensor in the table.")
    ] = 4,
    storage_options: Annotated[Optional[str], typer.Option("--storage-options", help=STORAGE_OPTIONS_HELP)] = None,
) -> None:
    """Show what a checkpoint holds: tensors and their placements, files, topology, state, metadata.

    Reads only [bold]manifest.json[/bold] (fully checked). Exit code 2 when PATH does not exist or is not a
    checkpoint, 1 when its manifest is damaged; 0 otherwise, also when --tensor matches nothing (a note on
    stderr says so).
    """
    options = parse_storage_options(storage_options)
    import ucp

    try:
        manifest = ucp.read_manifest(path, storage_options=options)
    except (ucp.CheckpointError, OSError, ValueError, ImportError) as exc:
        raise fail_with(exc, unreadable_message(path, exc)) from None
    report = build_report(path, manifest)
    if tensor is not None:  # the name itself (which may hold [ or *), else the names the glob matches
        exact = [t for t in report.tensors if t.name == tensor]
        report.tensors = exact or [t for t in report.tensors if fnmatch.fnmatchcase(t.name, tensor)]
        if not report.tensors:  # an empty answer, not an error; but a typo should not pass unnoticed
            err.print(
                f"[yellow]note:[/yellow] no tensor matches {escape(repr(tensor))} "
                f"(the checkpoint holds {report.tensor_count})",
                highlight=False,
                soft_wrap=True,
            )
    if json_output:
        typer.echo(report.model_dump_json(indent=2))
    elif tensor is not None:
        if report.tensors:
            _print_tensors(report, max_pieces=max_pieces)
    else:
        _print_report(report, max_pieces=max_pieces)


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_cmd)
