"""``ucp.load``: a whole state dict back, or fill an existing (possibly differently sharded) one in place.

Whole loads read every data file in one sequential pass into a page-aligned
buffer (``reader.read_whole_file``: segments in flight while earlier ones are
checksummed). A tensor stored as a single piece comes back as a view on that
buffer (no copy: measured faster than copying, since fresh memory is costly to
fault in); tensors stored in several pieces are assembled into new tensors, and
when those make up most of a file the single-piece ones are copied out too, so
the file buffer can be freed.

``into=`` loads walk the given structure next to the manifest's state tree and
work out, for every tensor to fill, which stored pieces intersect its box or
flat range (``reshard.box``). Only those pieces are read: all of each piece
when verifying its CRC, just the needed span of it otherwise. A piece whose
layout equals its target's is read straight into the target's memory (see
``ucp.partial``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from aio import AioConfig
from reshard.box import Box

from .dist import resolve_group
from .dtypes import torch_dtype
from .errors import CheckpointError, LayoutMismatchError
from .manifest import Manifest, TensorEntry, parse_manifest
from .partial import Target, read_targets
from .reader import FileBuffer, FilePiece, pieces_by_file, read_checkpoint_manifest, read_manifest, read_whole_file
from .regions import copy_region
from .sharding import FlatShard, ShardedTensor, is_tensor_like, parts_of
from .storage import Storage, as_aio_config, open_storage
from .tree import decode_state, dict_items, node_kind, path_str, tensor_refs


def load(path: str | os.PathLike[str], *, into: dict[str, Any] | None = None, verify: bool = True,
         process_group: Any = None, aio_config: AioConfig | dict[str, Any] | None = None,
         storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load the checkpoint at ``path``.

    Without ``into`` returns the saved state dict, sharded tensors assembled into full
    ones. With ``into`` fills that structure in place (tensors ``copy_``'d with a dtype
    cast where needed, ShardedTensor/FlatShard locals with their part, other values
    replaced) reading only the bytes it needs, and returns it. ``verify`` checks the
    CRC-32C of every piece read. With an explicit ``process_group`` rank 0 reads the
    manifest and broadcasts it; without, every rank reads it itself (no collectives).
    """
    storage, name = open_storage(path, storage_options=storage_options, aio_config=as_aio_config(aio_config))
    with storage:
        manifest = _manifest(storage, name, process_group)
        if into is None:
            return load_full(storage, name, manifest, verify=verify)
        return load_into(storage, name, manifest, into, verify=verify)


def _manifest(storage: Storage, name: str, process_group: Any) -> Manifest:
    if process_group is None:
        return read_manifest(storage, name)
    group = resolve_group(process_group)
    data, error, failure = None, None, None
    if group.rank == 0:
        try:
            manifest = read_manifest(storage, name)
            data = manifest.to_json().decode()
        except Exception as exc:  # every rank must reach the broadcast
            failure, error = exc, f"{type(exc).__name__}: {exc}"
    data, error = group.broadcast((data, error))
    if failure is not None:
        raise failure
    if group.rank == 0:
        return manifest
    if data is None:
        raise CheckpointError(f"rank 0 could not read the manifest: {error}")
    return parse_manifest(data, source=storage.describe(f"{name}/manifest.json"))


# -- whole loads ----------------------------------------------------------------------------------


def empty_tensor(entry: TensorEntry) -> torch.Tensor:
    return torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))


def piece_tensor(buf: FileBuffer, fp: FilePiece) -> torch.Tensor:
    """A piece's elements as a 1-d tensor viewing ``buf`` (the file's bytes), no copy."""
    p = fp.piece
    dtype = torch_dtype(fp.dtype)
    if p.length == 0:
        return torch.empty(0, dtype=dtype)
    return buf.tensor(p.length, p.offset).view(dtype)


def load_full(storage: Storage, name: str, manifest: Manifest, *, verify: bool) -> dict[str, Any]:
    """Every tensor in full, then the state tree rebuilt around them."""
    tensors: dict[str, torch.Tensor] = {}
    for tname, entry in manifest.tensors.items():
        if len(entry.pieces) != 1:  # assembled from pieces (or empty)
            tensors[tname] = empty_tensor(entry)
    for file, fps in pieces_by_file(manifest).items():
        if not fps:
            continue
        size = manifest.files[file].size
        buf, _ = read_whole_file(storage, name, file, size, fps, verify=verify)
        # Zero copy keeps the whole file buffer alive; worth it unless much of the file is
        # pieces of sharded tensors, which are copied out anyway (then copy everything).
        assembled = sum(fp.piece.length for fp in fps if len(manifest.tensors[fp.tensor].pieces) != 1)
        zero_copy = assembled * 2 <= size
        for fp in fps:
            entry = manifest.tensors[fp.tensor]
            src = piece_tensor(buf, fp)
            if len(entry.pieces) == 1:
                view = src.view(entry.shape)
                tensors[fp.tensor] = view if zero_copy else view.clone()
            else:
                copy_region(src, fp.piece.region(), 0, tensors[fp.tensor], Box.full(entry.shape), entry.shape)
        del buf, src
    return decode_state(manifest.state, tensors.__getitem__)


# -- loads into a given structure -----------------------------------------------------------------


@dataclass
class IntoPlan:
    targets: list[Target] = field(default_factory=list)
    assigns: list[tuple[Any, Any, Any]] = field(default_factory=list)  # (container, key, stored node)


def _kind_text(node: Any) -> str:
    kind = node_kind(node)
    return {"scalar": f"the value {node!r}"[:80], "tensor": "a tensor", "items": "a dict", "dict": "a dict"}.get(kind, f"a {kind}")


def plan_into(manifest: Manifest, into: dict[str, Any]) -> IntoPlan:
    """Match ``into`` against the manifest's state tree; LayoutMismatchError where they disagree."""
    if not isinstance(into, dict):
        raise LayoutMismatchError(f"into= must be a dict, got {type(into).__name__}")
    plan = IntoPlan()
    _walk(manifest, into, manifest.state, (), plan)
    return plan


def _is_container(v: Any) -> bool:
    return isinstance(v, (dict, list, tuple)) and not is_tensor_like(v)


def _walk(m: Manifest, obj: Any, node: Any, path: tuple[Any, ...], plan: IntoPlan) -> None:
    here = path_str(path)
    kind = node_kind(node)
    if is_tensor_like(obj):
        if kind != "tensor":
            raise LayoutMismatchError(f"{here}: the checkpoint holds {_kind_text(node)} here, not a tensor")
        plan.targets.extend(_target(m, node["tensor"], part, path) for part in parts_of(obj))
        return
    if isinstance(obj, dict):
        if kind not in ("dict", "items"):
            raise LayoutMismatchError(f"{here}: the checkpoint holds {_kind_text(node)} here, not a dict")
        stored = {(type(k), k): v for k, v in dict_items(node)}
        for k, v in obj.items():
            child = stored.get((type(k), k))
            if child is None and (type(k), k) not in stored:
                raise LayoutMismatchError(f"{path_str(path + (k,))} is not in the checkpoint")
            _child(m, obj, k, v, child, path + (k,), plan)
        return
    if isinstance(obj, (list, tuple)):
        want = "list" if isinstance(obj, list) else "tuple"
        items = node if kind == "list" else (node["tuple"] if kind == "tuple" else None)
        if items is None or kind != want:
            raise LayoutMismatchError(f"{here}: the checkpoint holds {_kind_text(node)} here, not a {want}")
        if len(items) != len(obj):
            raise LayoutMismatchError(f"{here}: the checkpoint's {want} has {len(items)} items, the target {len(obj)}")
        for i, (v, child) in enumerate(zip(obj, items)):
            _child(m, obj, i, v, child, path + (i,), plan)
        return
    raise AssertionError("plain values are handled by the parent")


def _child(m: Manifest, parent: Any, key: Any, value: Any, node: Any, path: tuple[Any, ...], plan: IntoPlan) -> None:
    if is_tensor_like(value) or _is_container(value):
        _walk(m, value, node, path, plan)
    elif not isinstance(parent, tuple):
        plan.assigns.append((parent, key, node))


def _target(m: Manifest, name: str, obj: Any, path: tuple[Any, ...]) -> Target:
    entry = m.tensors[name]
    shape = tuple(entry.shape)
    if isinstance(obj, ShardedTensor):
        buffer, gshape, region = obj.local, obj.global_shape, obj.box
    elif isinstance(obj, FlatShard):
        buffer, gshape, region = obj.local, obj.global_shape, obj.range
    else:
        buffer, gshape, region = obj, tuple(obj.shape), Box.full(tuple(obj.shape))
    if tuple(gshape) != shape:
        raise LayoutMismatchError(
            f"{path_str(path)} (tensor {name!r}): the checkpoint's shape is {list(shape)}, the target's {list(gshape)}"
        )
    return Target(name, buffer, region, path)


def load_into(storage: Storage, name: str, manifest: Manifest, into: dict[str, Any], *, verify: bool) -> dict[str, Any]:
    plan = plan_into(manifest, into)
    # Values that replace plain entries of ``into`` may reference tensors: load those in full.
    full: dict[str, torch.Tensor] = {}
    targets = list(plan.targets)
    for _, _, node in plan.assigns:
        for ref in tensor_refs(node):
            entry = manifest.tensors[ref]
            full[ref] = empty_tensor(entry)
            targets.append(Target(ref, full[ref], Box.full(tuple(entry.shape)), ()))
    read_targets(storage, name, manifest, targets, verify=verify)
    for container, key, node in plan.assigns:
        container[key] = decode_state(node, full.__getitem__)
    return into
