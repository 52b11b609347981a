"""The few collectives a save needs, and a no-op stand-in for single-process jobs.

Messages are JSON strings (torch.distributed's object collectives carry them);
a save uses a broadcast of the temporary directory name, a gather of each rank's
piece records at commit, and a broadcast of the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class Group:
    rank: int
    world_size: int
    pg: Any = None  # None: no torch.distributed (one process)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.pg is not None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=self._global(src), group=self.pg)
        return box[0]

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on rank ``dst`` (in rank order); None elsewhere."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self._global(dst), group=self.pg)
        return out

    def _global(self, group_rank: int) -> int:
        if self.pg is None or self.pg is dist.GroupMember.WORLD:
            return group_rank
        return dist.get_global_rank(self.pg, group_rank)


def resolve_group(process_group: Any = None, *, use_default: bool = True) -> Group:
    """The group a save/load runs in: ``process_group``, else the default group when initialised, else one process."""
    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        return Group(0, 1, None)
    if process_group is None:
        if not use_default:
            return Group(0, 1, None)
        process_group = dist.GroupMember.WORLD
    rank = dist.get_rank(process_group)
    if process_group is dist.GroupMember.NON_GROUP_MEMBER or rank < 0:  # torch's collectives would do nothing
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of process_group; "
            "only its members save or load through it"
        )
    return Group(rank, dist.get_world_size(process_group), process_group)
