"""Saving DTensors (FSDP2, tensor parallel, any DeviceMesh): each rank writes its own shard, once.

A DTensor leaf becomes what the planner already knows: a ``ShardedTensor`` (one region of the
global tensor) or ``Shards`` (several, for ``_StridedShard``) viewing the DTensor's local memory,
with ``replica_id`` > 0 on the copies a ``Replicate`` mesh dim makes, so that each element is
written by exactly one rank. ``Partial`` placements (unreduced values) are refused, and so is a
DTensor whose mesh is not exactly the save's process group: its shards would be written by
ranks that do not take part, or by none.

The placements are recorded in the manifest's metadata under ``dtensor`` (docs/format.md,
conventional metadata): per tensor its mesh, torch's placements and the dim pattern.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ucp.dist import Group
from ucp.errors import UnsupportedStateError
from ucp.format.dtensor import DTensorView, is_dtensor, view_of
from ucp.format.sharding import ShardedTensor, Shards
from ucp.format.tree import Leaf, path_str

METADATA_KEY = "dtensor"


def group_ranks(group: Group) -> tuple[int, ...]:
    """The global ranks of the save's group, in group order."""
    if group.pg is None:
        return tuple(range(group.world_size))
    import torch.distributed as dist

    if group.pg is dist.GroupMember.WORLD:
        return tuple(range(group.world_size))
    return tuple(int(r) for r in dist.get_process_group_ranks(group.pg))


def lower_leaves(leaves: Sequence[Leaf], group: Group) -> tuple[list[Leaf], dict[str, Any]]:
    """The leaves with every DTensor replaced by the regions this rank writes, and the placement
    record per tensor name (empty when there is no DTensor). UnsupportedStateError naming the key
    for a DTensor that cannot be saved."""
    out: list[Leaf] = []
    records: dict[str, Any] = {}
    ranks: tuple[int, ...] | None = None
    for leaf in leaves:
        if not is_dtensor(leaf.value):
            out.append(leaf)
            continue
        if ranks is None:
            ranks = group_ranks(group)
        where = f"{path_str(leaf.path)} (tensor {leaf.name!r})"
        view = view_of(leaf.value)
        _check(view, ranks, where)
        out.append(dataclasses.replace(leaf, value=_regions(view, where)))
        records[leaf.name] = view.record()
    return out, records


def _check(view: DTensorView, ranks: tuple[int, ...], where: str) -> None:
    bad = [s.text for s in view.specs if s.kind in ("partial", "unknown")]
    if bad:
        raise UnsupportedStateError(
            f"{where}: a DTensor with placement {', '.join(bad)} cannot be saved: its local values are not "
            "the tensor's (Partial holds unreduced partial sums); redistribute it first, e.g. "
            "t.redistribute(t.device_mesh, [Replicate()]) or [Shard(0)]"
        )
    if sorted(view.mesh_ranks) != sorted(ranks):
        raise UnsupportedStateError(
            f"{where}: the DTensor's DeviceMesh spans {len(view.mesh_ranks)} rank(s) {_ranks(view.mesh_ranks)}, "
            f"but the save's process group has {len(ranks)} {_ranks(ranks)}: every rank of the mesh, and no "
            "other, must take part (save with process_group= the mesh's group, or put replicas in the mesh "
            "as a Replicate() dim)"
        )


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, list(ranks)[:8]))
    return f"[{shown}{', ...' if len(ranks) > 8 else ''}]"


def _regions(view: DTensorView, where: str) -> ShardedTensor | Shards:
    """The local tensor as the regions of the global tensor it holds; a rank holding none (an empty
    uneven shard) gives an empty region that it does not write."""
    try:
        pairs = view.regions()
    except ValueError as exc:
        raise UnsupportedStateError(f"{where}: {exc}") from None
    replica = view.replica()
    shape = view.global_shape
    if not pairs:
        return ShardedTensor(view.local.reshape(tuple(0 for _ in shape)), shape, (0,) * len(shape), replica_id=1)
    parts = [
        ShardedTensor(
            view.local[tuple(slice(o, o + n) for o, n in zip(lb.offsets, lb.shape))], shape, gb.offsets, replica
        )
        for lb, gb in pairs
    ]
    return parts[0] if len(parts) == 1 else Shards(parts)


def with_record(metadata: dict[str, Any] | None, records: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with the placement records under ``dtensor`` (a copy; the caller's dict is not
    changed). A ``dtensor`` key the caller set is theirs: it is kept and nothing is recorded."""
    if not records or (metadata is not None and METADATA_KEY in metadata):
        return metadata or {}
    return {**(metadata or {}), METADATA_KEY: records}
