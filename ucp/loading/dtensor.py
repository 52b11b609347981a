"""Loading into DTensors: each rank fills its local shard from the stored pieces it intersects.

A DTensor target becomes the regions of the global tensor its local memory holds (views on the
local tensor; ``ucp.format.dtensor``), which the ``into=`` planner fills like any sharded target,
reading only the byte ranges this rank needs. Every rank fills its own copy of replicated data.
A ``Partial`` target is refused: no stored value says how to split a sum over ranks.
"""

from __future__ import annotations

from typing import Any

from ucp.errors import LayoutMismatchError
from ucp.format.dtensor import is_dtensor, view_of
from ucp.format.sharding import ShardedTensor, Shards
from ucp.format.tree import path_str


def as_target(obj: Any, path: tuple[Any, ...]) -> Any:
    """``obj`` as a load target: a DTensor as the regions its local tensor holds (a rank holding none,
    e.g. an empty uneven shard, gets an empty region), anything else unchanged."""
    if not is_dtensor(obj):
        return obj
    view = view_of(obj)
    bad = [s.text for s in view.specs if s.kind in ("partial", "unknown")]
    if bad:
        raise LayoutMismatchError(
            f"{path_str(path)}: a DTensor with placement {', '.join(bad)} cannot be loaded into (its local values "
            "would be partial sums); load into a Shard or Replicate DTensor and redistribute"
        )
    try:
        pairs = view.regions()
    except ValueError as exc:
        raise LayoutMismatchError(f"{path_str(path)}: {exc}") from None
    shape = view.global_shape
    if not pairs:
        return ShardedTensor(view.local.reshape(tuple(0 for _ in shape)), shape, (0,) * len(shape))
    parts = [
        ShardedTensor(view.local[tuple(slice(o, o + n) for o, n in zip(lb.offsets, lb.shape))], shape, gb.offsets)
        for lb, gb in pairs
    ]
    return parts[0] if len(parts) == 1 else Shards(parts)
