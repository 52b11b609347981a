"""``ucp.load``: a whole state dict back, or fill an existing (possibly differently sharded) one in place.

Whole loads read every data file in one sequential pass into a page-aligned
buffer (``reader.read_whole_file``: segments in flight while earlier ones are
checksummed, the buffer faulted in by another thread just ahead of them). A
tensor stored as a single piece comes back as a view on that buffer (no copy:
measured faster than copying, since fresh memory is costly to fault in); the few
tensors stored in several pieces are assembled into new tensors. When such
tensors make up most of the checkpoint (ZeRO-3, TP), each tensor is allocated
whole instead (large ones as their own mapping, faulted in ahead of the reads in
read order) and its pieces are read straight into it (``_load_assembled``).

``into=`` loads walk the given structure next to the manifest's state tree and
work out, for every tensor to fill, which stored pieces intersect its box or
flat range (``reshard.box``). Only those pieces are read: all of each piece
when verifying its CRC, just the needed span of it otherwise. A piece whose
layout equals its target's is read straight into the target's memory (see
``ucp.loading.partial``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import torch

from aio import AioConfig
from aio.populate import Populator
from reshard.box import Box, FlatRange, flat_span
from ucp.dist import resolve_group
from ucp.errors import CheckpointError, LayoutMismatchError
from ucp.format.dtypes import itemsize, torch_dtype
from ucp.format.manifest import Manifest, TensorEntry, parse_manifest
from ucp.format.regions import copy_region
from ucp.format.sharding import FlatShard, ShardedTensor, StreamedShard, is_tensor_like, parts_of
from ucp.format.tree import decode_state, dict_items, node_kind, path_str, plain_key, tensor_refs
from ucp.loading.device import DevicePlan, GdsOption, check_gds_option, plan_device_load, read_direct
from ucp.loading.dtensor import as_target
from ucp.loading.partial import Target, read_targets
from ucp.store.reader import (
    POPULATE_MIN_BYTES,
    POPULATE_THREADS,
    FileBuffer,
    FilePiece,
    check_data_files,
    pieces_by_file,
    read_manifest,
    read_whole_file,
)
from ucp.store.storage import Storage, as_aio_config, open_storage


@overload
def load(
    path: str | os.PathLike[str],
    *,
    into: dict[str, Any] | None = None,
    strict: Literal[True] = True,
    map_location: str | torch.device | None = None,
    gds: GdsOption = "auto",
    verify: bool = True,
    process_group: Any = None,
    aio_config: AioConfig | dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]: ...


@overload
def load(
    path: str | os.PathLike[str],
    *,
    into: dict[str, Any] | None = None,
    strict: Literal[False],
    map_location: str | torch.device | None = None,
    gds: GdsOption = "auto",
    verify: bool = True,
    process_group: Any = None,
    aio_config: AioConfig | dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> LoadReport: ...


def load(
    path: str | os.PathLike[str],
    *,
    into: dict[str, Any] | None = None,
    strict: bool = True,
    map_location: str | torch.device | None = None,
    gds: GdsOption = "auto",
    verify: bool = True,
    process_group: Any = None,
    aio_config: AioConfig | dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any] | LoadReport:
    """Load the checkpoint at ``path``.

    Without ``into`` returns the saved state dict, sharded tensors assembled into full
    ones, on ``map_location`` (default: CPU; dtypes as saved; ``"cuda"`` raises a
    CheckpointError where CUDA is not usable). With ``into`` fills that structure in place
    (tensors ``copy_``'d with a dtype cast where needed, ShardedTensor/FlatShard locals with
    their part, other values replaced) reading only the bytes it needs, and returns it.

    ``strict`` (the default): every key of ``into`` must be in the checkpoint, and every key the
    checkpoint holds inside a dict ``into`` describes must be in it too (the top level only selects:
    ``into={"model": ...}`` leaves the checkpoint's other sections unread); otherwise one
    LayoutMismatchError names all the missing and unexpected keys (and suggests the prefix when
    one explains them, e.g. ``into={"model": ...}``), before anything is read. ``strict=False``
    fills what matches and returns a :class:`LoadReport` (``.state``: the loaded state or
    ``into``; ``.loaded``, ``.missing``, ``.unexpected``: key paths). Shape, dtype-kind and
    structure mismatches are errors either way.

    ``gds`` (whole loads onto CUDA only): ``"auto"`` lets KvikIO read tensors stored whole straight into
    device memory when ``verify=False`` and KvikIO is usable; ``"on"`` requires that (a CheckpointError
    naming what is missing otherwise); ``"off"`` always stages through host memory. See
    ``ucp.loading.device``; ``LoadReport.device_plan`` says which path was taken.

    ``verify`` checks the CRC-32C of every piece read (not of direct KvikIO reads, which it rules out). With an explicit ``process_group``
    rank 0 reads the manifest and broadcasts it; without, every rank reads it itself (no
    collectives). Every data file's size is checked against the manifest before anything is
    allocated.
    """
    device = resolve_device(map_location)
    gds = check_gds_option(gds)
    if into is not None and map_location is not None:
        raise CheckpointError("map_location applies to whole loads; with into= tensors are filled where they are")
    if gds == "on" and device is None:
        raise CheckpointError("gds='on' applies to whole loads with map_location='cuda'")
    storage, name = open_storage(path, storage_options=storage_options, aio_config=as_aio_config(aio_config))
    with storage:
        manifest = _manifest(storage, name, process_group)
        if into is None:
            plans: list[DevicePlan] = []
            state = load_full(storage, name, manifest, verify=verify, device=device, gds=gds, plans=plans)
            if strict:
                return state
            return LoadReport(
                state,
                loaded=[(k,) for k in state],
                missing=[],
                unexpected=[],
                device_plan=plans[0] if plans else None,
            )
        report = load_into(storage, name, manifest, into, verify=verify, strict=strict)
        return report.state if strict else report


def resolve_device(map_location: str | torch.device | None) -> torch.device | None:
    """The device a whole load puts its tensors on (None: CPU, the zero-copy path); a CheckpointError
    for a device this process cannot use (``"cuda"`` without CUDA), before anything is read."""
    if map_location is None:
        return None
    try:
        device = torch.device(map_location)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"map_location={map_location!r} is not a device: {exc}") from None
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(
                f"map_location={str(map_location)!r}: CUDA is not available in this process "
                "(no GPU visible, or torch built without CUDA); load to 'cpu' instead"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CheckpointError(
                f"map_location={str(map_location)!r}: this process sees {torch.cuda.device_count()} GPU(s)"
            )
        return device
    raise CheckpointError(f"map_location={str(map_location)!r}: only 'cpu' and 'cuda' devices are supported")


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


def load_full(
    storage: Storage,
    name: str,
    manifest: Manifest,
    *,
    verify: bool,
    device: torch.device | None = None,
    gds: GdsOption = "auto",
    plans: list[DevicePlan] | None = None,
) -> dict[str, Any]:
    """Every tensor in full, then the state tree rebuilt around them; on ``device`` when given (not CPU),
    with the path chosen for it (``gds``, see ``ucp.loading.device``) appended to ``plans`` when given."""
    check_data_files(storage, name, manifest)  # before any tensor is allocated from the manifest's shapes
    if device is not None:
        on_device, plan = _load_to_device(storage, name, manifest, device, verify=verify, gds=gds)
        if plans is not None:
            plans.append(plan)
        return decode_state(manifest.state, on_device.__getitem__)
    total = sum(e.nbytes for e in manifest.tensors.values())
    assembled = sum(e.nbytes for e in manifest.tensors.values() if len(e.pieces) > 1)
    if assembled * 2 > total:  # mostly sharded: read the pieces straight into the full tensors
        return decode_state(manifest.state, _load_assembled(storage, name, manifest, verify=verify).__getitem__)
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


def _load_assembled(storage: Storage, name: str, manifest: Manifest, *, verify: bool) -> dict[str, torch.Tensor]:
    """Every tensor allocated whole and its pieces read into it where they belong (``read_targets``:
    straight into the tensor's memory where the piece is contiguous there), for checkpoints whose
    tensors are mostly split across files (a ZeRO-3 or TP checkpoint loaded in full).

    Why not the whole-file path: it reads each file into a buffer and copies the pieces out, into
    fresh tensors, so every byte is faulted in twice and copied once. Here each large tensor is its
    own page-aligned mapping (freed when its last view dies, like any tensor), faulted in by another
    thread in the order the reads will reach it (:meth:`aio.populate.Populator.of_ranges`).
    """
    tensors: dict[str, torch.Tensor] = {}
    buffers: dict[str, FileBuffer] = {}
    for tname, entry in manifest.tensors.items():
        if entry.nbytes >= POPULATE_MIN_BYTES:
            buf = buffers[tname] = FileBuffer(entry.nbytes)
            tensors[tname] = buf.tensor(entry.nbytes).view(torch_dtype(entry.dtype)).view(entry.shape)
        else:
            tensors[tname] = empty_tensor(entry)
    ranges = []
    for fps in pieces_by_file(manifest).values():
        for fp in fps:
            dest = buffers.get(fp.tensor)
            if dest is None:
                continue
            region, shape = fp.piece.region(), manifest.tensors[fp.tensor].shape
            lo, hi = (region.start, region.stop) if isinstance(region, FlatRange) else flat_span(shape, region)
            size = itemsize(fp.dtype)
            ranges.append((dest.memory, lo * size, (hi - lo) * size))
    populator = Populator.of_ranges(ranges, threads=POPULATE_THREADS)
    try:
        targets = [Target(n, t, Box.full(tuple(t.shape)), ()) for n, t in tensors.items()]
        read_targets(storage, name, manifest, targets, verify=verify)
    finally:
        populator.close()
    return tensors


def _load_to_device(
    storage: Storage, name: str, manifest: Manifest, device: torch.device, *, verify: bool, gds: GdsOption
) -> tuple[dict[str, torch.Tensor], DevicePlan]:
    """Every tensor allocated on ``device`` (dtype as stored). Those the plan reads directly are filled by KvikIO
    from the file into device memory; the rest by the ``into=`` planner: pieces read into host staging,
    checked, and copied to the device, within the planner's staging memory."""
    import gds as gds_pkg

    plan = plan_device_load(storage, name, manifest, gds=gds, verify=verify, caps=gds_pkg.capabilities())
    tensors = {n: torch.empty(e.shape, dtype=torch_dtype(e.dtype), device=device) for n, e in manifest.tensors.items()}
    direct = set(plan.direct)
    targets = [Target(n, t, Box.full(tuple(t.shape)), ()) for n, t in tensors.items() if n not in direct]
    read_targets(storage, name, manifest, targets, verify=verify)
    read_direct(storage, name, manifest, tensors, plan)
    return tensors, plan


# -- loads into a given structure -----------------------------------------------------------------


@dataclass
class IntoPlan:
    targets: list[Target] = field(default_factory=list)
    assigns: list[tuple[Any, Any, Any]] = field(default_factory=list)  # (container, key, stored node)
    # tuples cannot change in place: one holding plain values is rebuilt around its (filled) tensors
    # and put back into its container: (container, key, the tuple in ``into``, its stored node)
    rebuilds: list[tuple[Any, Any, tuple, Any]] = field(default_factory=list)
    loaded: list[tuple[Any, ...]] = field(default_factory=list)  # key paths of the tensors and values filled
    missing: list[tuple[Any, ...]] = field(default_factory=list)  # in ``into``, not in the checkpoint
    unexpected: list[tuple[Any, ...]] = field(default_factory=list)  # in the checkpoint, not in ``into``'s dicts
    skipped: list[tuple[Any, ...]] = field(default_factory=list)  # top-level keys ``into`` does not ask for


@dataclass
class LoadReport:
    """What a ``strict=False`` load did: ``state`` is what it returns otherwise (the filled ``into``, or
    the whole state); ``loaded``: key paths filled (tensors and plain values); ``missing``: key paths of
    ``into`` the checkpoint lacks (left as they were); ``unexpected``: key paths the checkpoint holds
    inside a dict of ``into`` that lacks them (not read); ``skipped``: the checkpoint's top-level keys
    ``into`` does not ask for (sections not read, e.g. the optimizer's for ``into={"model": ...}``);
    ``device_plan``: for a whole load onto CUDA, the I/O path taken (``"gds"``: the tensors in
    ``direct`` read by KvikIO into device memory, or ``"staged"``) and why; None otherwise.
    A key path is a tuple of keys, e.g. ``("optim", "state", 0)``."""

    state: dict[str, Any]
    loaded: list[tuple[Any, ...]]
    missing: list[tuple[Any, ...]]
    unexpected: list[tuple[Any, ...]]
    skipped: list[tuple[Any, ...]] = field(default_factory=list)
    device_plan: DevicePlan | None = None

    @property
    def complete(self) -> bool:
        """True when ``into`` and the checkpoint matched key for key (what ``strict=True`` demands)."""
        return not self.missing and not self.unexpected


MAX_KEYS_NAMED = 12  # keys listed per kind in a strict-load error; the rest are counted


def _key_list(paths: list[tuple[Any, ...]]) -> str:
    named = ", ".join(path_str(p) for p in paths[:MAX_KEYS_NAMED])
    return named + (f" and {len(paths) - MAX_KEYS_NAMED} more" if len(paths) > MAX_KEYS_NAMED else "")


def strict_error(where: str, plan: IntoPlan, manifest: Manifest, into: dict[str, Any]) -> LayoutMismatchError:
    """One error naming every missing and every unexpected key, with a hint when a prefix explains them."""
    parts = []
    if plan.missing:
        parts.append(f"missing from the checkpoint (in into= but not saved): {_key_list(plan.missing)}")
    if plan.unexpected:
        parts.append(f"unexpected (saved but not in into=): {_key_list(plan.unexpected)}")
    if plan.skipped and any(len(p) == 1 for p in plan.missing):
        parts.append(f"the checkpoint's other top-level keys: {_key_list(plan.skipped)}")
    hints = [h for h in (_prefix_hint(plan, manifest, into), _empty_hint(plan, into)) if h]
    return LayoutMismatchError(
        f"into= does not match the checkpoint {where}: "
        + "; ".join(parts)
        + "."
        + "".join(f" {h}" for h in hints)
        + " Pass strict=False to load what matches (it returns a LoadReport of what was and was not filled)."
    )


def _empty_hint(plan: IntoPlan, into: dict[str, Any]) -> str | None:
    """Why a fresh optimizer's state_dict loads nothing: its 'state' is an empty dict, so the saved entries
    have nowhere to go. Names the first such dict of ``into``."""
    for path in plan.unexpected:
        container: Any = into
        for k in path[:-1]:
            container = container[k]
        if isinstance(container, dict) and not container:
            top = path[0]
            return (
                f"{path_str(path[:-1])} is empty in into= (e.g. a fresh optimizer's state_dict(), which holds no "
                f"state before its first step), so the saved entries have nowhere to go: load that part whole, "
                f"e.g. optimizer.load_state_dict(ucp.load(path)[{top!r}]) when it is an optimizer's."
            )
    return None


def _prefix_hint(plan: IntoPlan, manifest: Manifest, into: dict[str, Any]) -> str | None:
    """'did you mean into={"model": ...}' when the checkpoint holds ``into``'s keys under one top-level key,
    or 'pass into["model"] itself' when ``into`` holds the checkpoint's top-level keys under one key."""
    top_missing = [p[0] for p in plan.missing if len(p) == 1]
    top_unexpected = [p[0] for p in plan.skipped]
    stored = dict(dict_items(manifest.state)) if node_kind(manifest.state) in ("dict", "items") else {}
    if top_missing:
        for key in top_unexpected:
            node = stored.get(key)
            if isinstance(node, dict) and node_kind(node) in ("dict", "items"):
                inner = {_key(k) for k, _ in dict_items(node)}
                if all(_key(k) in inner for k in top_missing):
                    return (
                        f"The checkpoint holds these keys under {key!r}: did you mean into={{{key!r}: ...}} "
                        f"(e.g. into={{{key!r}: model.state_dict()}})?"
                    )
    if len(top_missing) == 1 and isinstance(into.get(top_missing[0]), dict):
        wrapped = {_key(k) for k in into[top_missing[0]]}
        if stored and all(_key(k) in wrapped for k in stored):
            return (
                f"The checkpoint holds the keys of into[{top_missing[0]!r}] at its top level: "
                f"pass that dict itself (into=into[{top_missing[0]!r}])."
            )
    return None


def _kind_text(node: Any) -> str:
    kind = node_kind(node)
    return {"scalar": f"the value {node!r}"[:80], "tensor": "a tensor", "items": "a dict", "dict": "a dict"}.get(
        kind, f"a {kind}"
    )


def plan_into(manifest: Manifest, into: dict[str, Any]) -> IntoPlan:
    """Match ``into`` against the manifest's state tree; LayoutMismatchError where they disagree."""
    if not isinstance(into, dict):
        raise LayoutMismatchError(f"into= must be a dict, got {type(into).__name__}")
    plan = IntoPlan()
    _walk(manifest, into, manifest.state, (), plan)
    return plan


def _is_container(v: Any) -> bool:
    return isinstance(v, (dict, list, tuple)) and not is_tensor_like(v)


def _walk(m: Manifest, obj: Any, node: Any, path: tuple[Any, ...], plan: IntoPlan) -> bool:
    """Plan the filling of ``obj`` from ``node``; True when ``obj`` is a tuple that must be rebuilt.
    (``path`` is formatted only for an error: doing it at every node costs depth x key length each.)"""
    kind = node_kind(node)
    if is_tensor_like(obj):
        if kind != "tensor":
            raise LayoutMismatchError(f"{path_str(path)}: the checkpoint holds {_kind_text(node)} here, not a tensor")
        plan.targets.extend(_target(m, node["tensor"], part, path) for part in parts_of(as_target(obj, path)))
        plan.loaded.append(path)
        return False
    if isinstance(obj, dict):
        if kind not in ("dict", "items"):
            raise LayoutMismatchError(f"{path_str(path)}: the checkpoint holds {_kind_text(node)} here, not a dict")
        stored = {_key(k): (k, v) for k, v in dict_items(node)}
        wanted = set()
        for k, v in obj.items():
            wanted.add(_key(k))
            if _key(k) not in stored:
                plan.missing.append(path + (k,))
                continue
            _child(m, obj, k, v, stored[_key(k)][1], path + (k,), plan)
        # the top level selects sections (into={"model": ...} leaves the optimizer unread); below it, every
        # key of a dict ``into`` describes must be there
        (plan.unexpected if path else plan.skipped).extend(
            path + (k,) for sk, (k, _) in stored.items() if sk not in wanted
        )
        return False
    if isinstance(obj, (list, tuple)):
        want = "list" if isinstance(obj, list) else "tuple"
        items = node if kind == "list" else (node["tuple"] if kind == "tuple" else None)
        if items is None or kind != want:
            raise LayoutMismatchError(f"{path_str(path)}: the checkpoint holds {_kind_text(node)} here, not a {want}")
        if len(items) != len(obj):
            raise LayoutMismatchError(
                f"{path_str(path)}: the checkpoint's {want} has {len(items)} items, the target {len(obj)}"
            )
        stale = [_child(m, obj, i, v, child, path + (i,), plan) for i, (v, child) in enumerate(zip(obj, items))]
        return isinstance(obj, tuple) and any(stale)
    raise AssertionError("plain values are handled by the parent")


def _child(m: Manifest, parent: Any, key: Any, value: Any, node: Any, path: tuple[Any, ...], plan: IntoPlan) -> bool:
    """Plan one entry of ``parent``; True when ``parent`` is a tuple that must be rebuilt for it."""
    if is_tensor_like(value) or _is_container(value):
        if not _walk(m, value, node, path, plan):
            return False
        if isinstance(parent, tuple):
            return True
        plan.rebuilds.append((parent, key, value, node))
        return False
    plan.loaded.append(path)
    if isinstance(parent, tuple):
        return True
    plan.assigns.append((parent, key, node))
    return False


def _key(key: Any) -> tuple[type, Any]:
    """How a key of ``into`` is matched with a stored one: by its plain value and type (str or int), so
    that an enum member finds what it was saved as, and 0 never matches "0"."""
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        k = plain_key(key)
        return type(k), k
    return type(key), key


def _plain_nodes(obj: tuple, node: Any) -> list[Any]:
    """The stored nodes of the plain values of a tuple to rebuild (nested tuples included)."""
    out = []
    for v, child in zip(obj, node["tuple"]):
        if isinstance(v, tuple) and not is_tensor_like(v):
            out.extend(_plain_nodes(v, child))
        elif not (is_tensor_like(v) or _is_container(v)):
            out.append(child)
    return out


def _rebuilt(obj: tuple, node: Any, tensor: Any) -> tuple:
    """``obj`` again with its plain values replaced by the stored ones; its tensors, dicts and lists
    (filled in place) are the same objects. Named tuples and ``torch.Size`` keep their type."""
    items = [
        _rebuilt(v, child, tensor)
        if isinstance(v, tuple) and not is_tensor_like(v)
        else v
        if is_tensor_like(v) or _is_container(v)
        else decode_state(child, tensor)
        for v, child in zip(obj, node["tuple"])
    ]
    if hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*items)
    return type(obj)(items)


def _target(m: Manifest, name: str, obj: Any, path: tuple[Any, ...]) -> Target:
    entry = m.tensors[name]
    shape = tuple(entry.shape)
    region: Box | FlatRange
    if isinstance(obj, ShardedTensor):
        buffer, gshape, region = obj.local, obj.global_shape, obj.box
    elif isinstance(obj, FlatShard):
        buffer, gshape, region = obj.local, obj.global_shape, obj.range
    elif isinstance(obj, StreamedShard):
        raise LayoutMismatchError(
            f"{path_str(path)} (tensor {name!r}): a StreamedShard is written by a save, it cannot be filled by a load"
        )
    else:
        buffer, gshape, region = obj, tuple(obj.shape), Box.full(tuple(obj.shape))
    if tuple(gshape) != shape:
        raise LayoutMismatchError(
            f"{path_str(path)} (tensor {name!r}): the checkpoint's shape is {list(shape)}, the target's {list(gshape)}"
        )
    return Target(name, _fillable(buffer, f"{path_str(path)} (tensor {name!r})"), region, path)


def _fillable(buffer: torch.Tensor, where: str) -> torch.Tensor:
    """The tensor to write into: refuses targets that cannot hold data, detaches ones that require grad.

    A parameter is filled in place like ``load_state_dict`` does (outside autograd, which refuses
    in-place writes to leaves that require grad); it keeps ``requires_grad``.
    """
    if buffer.device.type == "meta":
        raise LayoutMismatchError(
            f"{where}: the target is on the meta device, which holds no data; "
            "allocate it first (e.g. module.to_empty(device='cpu'))"
        )
    if any(st == 0 and n > 1 for st, n in zip(buffer.stride(), buffer.shape)):
        raise LayoutMismatchError(
            f"{where}: the target's elements share memory (a stride of 0, e.g. from "
            "expand()); it cannot hold distinct values"
        )
    return buffer.detach() if buffer.requires_grad else buffer


def load_into(
    storage: Storage, name: str, manifest: Manifest, into: dict[str, Any], *, verify: bool, strict: bool = True
) -> LoadReport:
    """Fill ``into`` (see :func:`load`); with ``strict`` a key mismatch is an error before anything is read."""
    check_data_files(storage, name, manifest)  # before any tensor is allocated, or ``into`` changed
    plan = plan_into(manifest, into)
    if strict and (plan.missing or plan.unexpected):
        raise strict_error(storage.describe(name), plan, manifest, into)
    # Values that replace plain entries of ``into`` may reference tensors: load those in full.
    full: dict[str, torch.Tensor] = {}
    targets = list(plan.targets)
    plain = [node for _, _, node in plan.assigns] + [
        n for _, _, tup, node in plan.rebuilds for n in _plain_nodes(tup, node)
    ]
    for node in plain:
        for ref in tensor_refs(node):
            if ref in full:
                continue
            entry = manifest.tensors[ref]
            full[ref] = empty_tensor(entry)
            targets.append(Target(ref, full[ref], Box.full(tuple(entry.shape)), ()))
    read_targets(storage, name, manifest, targets, verify=verify)
    for container, key, node in plan.assigns:
        container[key] = decode_state(node, full.__getitem__)
    for container, key, tup, node in plan.rebuilds:
        container[key] = _rebuilt(tup, node, full.__getitem__)
    return LoadReport(into, loaded=plan.loaded, missing=plan.missing, unexpected=plan.unexpected, skipped=plan.skipped)
