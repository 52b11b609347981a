"""Import a PyTorch Distributed Checkpoint (``torch.distributed.checkpoint`` FileSystemWriter output).

The folder holds ``.metadata`` (a pickle of DCP's ``Metadata``: every key's size and chunks, and
where each chunk's bytes are) and ``__<rank>_<n>.distcp`` data files, in which every tensor chunk
is a small ``torch.save`` archive at a byte range and every other value a ``torch.save`` of it.

``.metadata`` is never plainly unpickled: only DCP's own metadata classes, ``torch.Size``, dtypes
and layouts resolve (see :mod:`.pickles`). Chunks load with ``weights_only=True``. A tensor saved
as several chunks (a multi-rank save) becomes a ``ucp.Shards`` of its boxes. Keys keep DCP's
flattened names, nested back through the planner's record of the original key paths, so
``{"model": {"embed.weight": t}}`` saved by DCP comes back as that same nesting.
"""

from __future__ import annotations

import os
import pathlib
import stat
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ucp.conversion.importers.common import Imported, Progress, inside
from ucp.conversion.importers.errors import ForeignCheckpointError, UnknownFormatError
from ucp.conversion.importers.pickles import load_pickle_allowlisted, load_torch_bytes
from ucp.format.sharding import ShardedTensor, Shards

METADATA = ".metadata"


def _allowed_globals() -> dict[str, Any]:
    """The only names ``.metadata`` may resolve: DCP's metadata dataclasses and torch value types."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[str, Any] = {}
    for cls in (
        metadata.Metadata,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
    ):
        allowed[f"{cls.__module__}.{cls.__qualname__}"] = cls
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(metadata, name):
            allowed[f"torch.distributed.checkpoint.metadata.{name}"] = getattr(metadata, name)
    allowed["torch.Size"] = torch.Size
    allowed["torch.serialization._get_layout"] = torch.serialization._get_layout
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[f"torch.{name}"] = value
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[f"pathlib.{name}"] = getattr(pathlib, name)
        allowed[f"pathlib._local.{name}"] = getattr(pathlib, name)
    import collections

    allowed["collections.OrderedDict"] = collections.OrderedDict
    return allowed


def read_metadata(folder: Path, *, trust_pickle: bool = False) -> Any:
    """DCP's ``Metadata`` of ``folder``, unpickled through the allow-list."""
    from torch.distributed.checkpoint import metadata as md

    file = folder / METADATA
    if file.is_file():
        inside(folder, file)
    else:
        raise UnknownFormatError(f"no {METADATA} file in {str(folder)!r} (not a DCP checkpoint)", file=str(file))
    meta = load_pickle_allowlisted(file, _allowed_globals(), trust_pickle=trust_pickle)
    if not isinstance(meta, md.Metadata):
        raise ForeignCheckpointError(
            f"file {str(file)!r} does not hold DCP Metadata (got {type(meta).__name__})", file=str(file)
        )
    return meta


def _nest(state: dict[str, Any], path: tuple[Any, ...], value: Any, fqn: str, *, max_items: int, source: Path) -> None:
    """Put ``value`` at ``path``, rebuilding the containers DCP flattened: an int path item indexes a
    list (as DCP's own unflattening does), any other item is a dict key.

    A position of ``max_items`` or more is refused before any list grows to reach it:
    ``.metadata`` can claim any position and make ``[None] * position`` take all memory. Every
    list item DCP stores holds at least one key, so real positions stay below the number of keys
    plus the empty dicts (which DCP drops) before them; the caller allows a generous margin.
    """
    node: Any = state
    for key, following in zip(path[:-1], path[1:]):
        child = _get(node, key)
        if child is None:
            child = [] if type(following) is int else {}
            _put(node, key, child, fqn, max_items=max_items, source=source)
        if not isinstance(child, (dict, list)):
            raise ForeignCheckpointError(
                f"file {str(source)!r}: DCP key {fqn!r}: {key!r} is both a value and a container",
                tensor=fqn,
                file=str(source),
            )
        node = child
    _put(node, path[-1], value, fqn, max_items=max_items, source=source)


def max_list_items(keys: int) -> int:
    """The longest list a DCP checkpoint of ``keys`` keys is taken to hold: the keys, plus room for
    empty items DCP dropped (at most a million: 8 MB of placeholders)."""
    return max(keys, 1) * 16 + (1 << 20)


def _get(node: dict[Any, Any] | list[Any], key: Any) -> Any:
    if isinstance(node, dict):
        return node.get(key)
    return node[key] if type(key) is int and 0 <= key < len(node) else None


def _put(node: dict[Any, Any] | list[Any], key: Any, value: Any, fqn: str, *, max_items: int, source: Path) -> None:
    if isinstance(node, dict):
        node[key] = value
        return
    if type(key) is not int or not 0 <= key < max_items:
        raise ForeignCheckpointError(
            f"file {str(source)!r}: DCP key {fqn!r}: {str(key)[:40]!r} is not a position in a "
            f"list of at most {max_items} items",
            tensor=fqn,
            file=str(source),
        )
    node.extend([None] * (key + 1 - len(node)))
    node[key] = value


def read_dcp(path: str | os.PathLike[str], *, trust_pickle: bool = False, progress: Progress | None = None) -> Imported:
    """Read a DCP folder: every key, tensors in their saved dtype, chunks as boxes of the global tensor."""
    from torch.distributed.checkpoint import metadata as md

    folder = Path(path)
    meta = read_metadata(folder, trust_pickle=trust_pickle)
    by_fqn: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in meta.storage_data.items():
        by_fqn.setdefault(index.fqn, []).append((index, info))
    planner = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    handles: dict[str, BinaryIO] = {}
    state: dict[str, Any] = {}
    as_bytes: list[str] = []  # keys whose bytes values are stored as uint8 tensors (JSON cannot hold bytes)
    total = len(meta.state_dict_metadata)
    try:
        for i, (fqn, item) in enumerate(meta.state_dict_metadata.items()):
            entries = by_fqn.get(fqn, [])
            if not entries:
                raise ForeignCheckpointError(
                    f"file {str(folder / METADATA)!r}: no storage for key {fqn!r}",
                    tensor=fqn,
                    file=str(folder / METADATA),
                )
            if isinstance(item, md.TensorStorageMetadata):
                value = _tensor(folder, fqn, item, entries, handles, trust_pickle)
            else:
                index, info = entries[0]
                value = load_torch_bytes(
                    _read(folder, info, handles), where=_where(folder, info), trust_pickle=trust_pickle
                )
                if isinstance(value, (bytes, bytearray)):  # e.g. a dataloader's own serialized state: kept as bytes
                    value = (
                        torch.frombuffer(bytearray(value), dtype=torch.uint8)
                        if value
                        else torch.empty(0, dtype=torch.uint8)
                    )
                    as_bytes.append(fqn)
            key_path = tuple(planner.get(fqn) or (fqn,))
            _nest(state, key_path, value, fqn, max_items=max_list_items(total), source=folder / METADATA)
            if progress:
                progress(i + 1, total, fqn)
    finally:
        for fh in handles.values():
            fh.close()
    step = state.get("step") if isinstance(state.get("step"), int) and not isinstance(state.get("step"), bool) else None
    version = getattr(meta, "version", None)
    source: dict[str, Any] = {"format": "dcp", "path": str(folder.resolve()), "dcp_version": version}
    if as_bytes:
        source["bytes_as_uint8"] = as_bytes
    return Imported(state=state, step=step, metadata={"source": source})


def _where(folder: Path, info: Any) -> str:
    """Where a checked storage entry's bytes are, for messages."""
    return f"file {str(folder / str(info.relative_path))!r} bytes [{info.offset}, {info.offset + info.length})"


def _check_location(folder: Path, info: Any) -> str:
    """The data file name of a storage entry, after checking that ``.metadata`` gives a plain file name
    in the folder, and an offset and length that are non-negative integers."""
    source = str(folder / METADATA)
    name = str(getattr(info, "relative_path", ""))
    if "/" in name or name == "..":
        raise ForeignCheckpointError(f"file {source!r} points outside the folder: {name[:200]!r}", file=source)
    if name in ("", ".") or "\0" in name:
        raise ForeignCheckpointError(f"file {source!r} names data file {name!r}, which is not a file name", file=source)
    for field in ("offset", "length"):
        value = getattr(info, field, None)
        if type(value) is not int or value < 0:
            raise ForeignCheckpointError(
                f"file {source!r}: data file {name!r}: {field} {str(value)[:40]!r} is not a non-negative integer",
                file=source,
            )
    return name


def _open(folder: Path, name: str) -> BinaryIO:
    """A data file, opened without blocking on it and refused unless it is a regular file (a FIFO or a
    device named in ``.metadata`` would block or never end, a folder cannot be read)."""
    path = inside(folder, folder / name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ForeignCheckpointError(f"file {str(path)!r} is missing (listed in {METADATA})", file=str(path)) from None
    fh = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        fh.close()
        raise ForeignCheckpointError(f"file {str(path)!r} (listed in {METADATA}) is not a regular file", file=str(path))
    os.set_blocking(fd, True)
    return fh


def _read(folder: Path, info: Any, handles: dict[str, BinaryIO]) -> bytes:
    name = _check_location(folder, info)
    if getattr(info, "transform_descriptors", None):
        raise ForeignCheckpointError(
            f"{_where(folder, info)}: DCP stream transforms {list(info.transform_descriptors)} "
            "(e.g. compression) are not supported",
            file=str(folder / name),
        )
    if name not in handles:
        handles[name] = _open(folder, name)
    fh = handles[name]
    size = os.fstat(fh.fileno()).st_size
    if info.offset + info.length > size:  # checked before reading: the length is .metadata's claim
        raise ForeignCheckpointError(
            f"{_where(folder, info)}: runs past the end of the file ({size} bytes)",
            file=str(folder / name),
            offset=info.offset,
        )
    fh.seek(info.offset)
    data = fh.read(info.length)
    if len(data) != info.length:
        raise ForeignCheckpointError(
            f"{_where(folder, info)}: the file ends after {len(data)} bytes",
            file=str(folder / name),
            offset=info.offset,
        )
    return data


def _tensor(
    folder: Path, fqn: str, item: Any, entries: list[tuple[Any, Any]], handles: dict[str, BinaryIO], trust_pickle: bool
) -> torch.Tensor | Shards:
    size = tuple(int(s) for s in item.size)
    parts: list[ShardedTensor] = []
    for index, info in sorted(entries, key=lambda e: tuple(e[0].offset or ())):
        t = load_torch_bytes(_read(folder, info, handles), where=_where(folder, info), trust_pickle=trust_pickle)
        if not isinstance(t, torch.Tensor):
            raise ForeignCheckpointError(
                f"{_where(folder, info)}: key {fqn!r} should be a tensor, got {type(t).__name__}",
                tensor=fqn,
                file=str(folder / info.relative_path),
            )
        offsets = tuple(int(o) for o in (index.offset or (0,) * len(size)))
        if len(parts) == 0 and len(entries) == 1 and tuple(t.shape) == size:
            return t
        try:
            parts.append(ShardedTensor(t, size, offsets))
        except ValueError as exc:
            raise ForeignCheckpointError(
                f"{_where(folder, info)}: chunk of {fqn!r}: {exc}", tensor=fqn, file=str(folder / info.relative_path)
            ) from None
    return Shards(parts)
