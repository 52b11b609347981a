"""A process group with its size and this rank's index, whose collectives are no-ops at size 1.

torch.distributed reads ``group=None`` as "the whole world"; wrapping the group removes that trap
(an axis of size 1 has no group, and its collectives must do nothing) and keeps the size/index
arithmetic in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """A finished 'work' handle for collectives that needed no communication."""

    def wait(self) -> bool:
        return True


@dataclass(frozen=True)
class Comm:
    """Ranks ``ranks`` (global numbers, in group order); this process is ``ranks[index]``."""

    group: Any
    ranks: tuple[int, ...]
    index: int

    @classmethod
    def solo(cls, rank: int = 0) -> "Comm":
        return cls(None, (rank,), 0)

    @classmethod
    def world(cls) -> "Comm":
        """The whole world (or a solo group without torch.distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls.solo()
        n = dist.get_world_size()
        return cls(dist.group.WORLD if n > 1 else None, tuple(range(n)), dist.get_rank())

    @classmethod
    def of(cls, ranks: Sequence[int], group: Any, rank: int) -> "Comm":
        ranks = tuple(ranks)
        return cls(group if len(ranks) > 1 else None, ranks, ranks.index(rank))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def active(self) -> bool:
        return self.size > 1

    def all_reduce(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> Any:
        if not self.active:
            return _Done() if async_op else None
        return dist.all_reduce(t, op=op, group=self.group, async_op=async_op)

    def reduce(self, t: torch.Tensor, dst_index: int, async_op: bool = False) -> Any:
        """Sum ``t`` into group member ``dst_index`` (others' ``t`` is left undefined)."""
        if not self.active:
            return _Done() if async_op else None
        return dist.reduce(t, dst=self.ranks[dst_index], group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> Any:
        """``out`` (n) = sum over ranks of ``inp[index·n, (index+1)·n)``."""
        if not self.active:
            out.copy_(inp)
            return _Done() if async_op else None
        return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> Any:
        """``out`` (size·n) = the ``inp`` (n) of every rank, in group order."""
        if not self.active:
            out.copy_(inp)
            return _Done() if async_op else None
        return _all_gather(out, inp, group=self.group, async_op=async_op)

    def broadcast(self, t: torch.Tensor, src_index: int) -> None:
        if self.active:
            dist.broadcast(t, src=self.ranks[src_index], group=self.group)
