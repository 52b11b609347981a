"""Where every parameter sits in ZeRO's flat buffers: pure arithmetic, from reshard.zero.

The partition rule is the layout's (docs/patterns.md, section 4), computed by the same functions
(:func:`reshard.zero.group_partition`, :func:`reshard.zero.param_partition`), so the buffers this
runtime allocates are exactly the buffers a resolved layout describes, element for element:

* stages 0-2: a group's TP-local parameters, in model order, are concatenated into one flat buffer
  of ``T`` elements. Stages 1/2 cut it into ``D`` partitions of
  ``P = roundup(ceil(T / D), alignment)`` elements (rank ``d`` owns ``[d·P, (d+1)·P)``; the buffer is
  padded to ``D·P``). Stage 0 is one partition of the whole buffer (``P = T``) on every rank.
* stage 3: every parameter of ``n`` elements is cut on its own into ``D`` partitions of
  ``p = roundup(ceil(n / D), alignment)``; rank ``d`` owns ``[d·p, (d+1)·p)`` of it (past ``n``:
  padding). The group's buffer on a rank is its partitions of the members, concatenated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from reshard.zero import group_partition, param_partition, partition_size


@dataclass(frozen=True)
class Slice:
    """Param ``param``'s local flat elements ``[start, stop)`` sit at ``offset`` of this rank's partition."""

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class GroupPlan:
    """One parameter group on one rank: member names/shapes and the partition arithmetic."""

    index: int
    stage: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # TP-local shapes
    parts: int  # D: data-parallel ranks the group is partitioned over (1 at stage 0)
    rank: int  # d: this rank's index among them
    alignment: int
    offsets: tuple[int, ...] = field(init=False)  # stages 0-2: param starts in the flat group buffer;
    #                                               stage 3: member starts in this rank's partition buffer
    size: int = field(init=False)  # elements of this rank's partition buffer
    slices: tuple[Slice, ...] = field(init=False)  # what of each param this rank's partition holds

    def __post_init__(self) -> None:
        numels = [math.prod(s) for s in self.shapes]
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.stage == 3:
            offsets, slices, pos = [], [], 0
            for i, n in enumerate(numels):
                p, a, b = param_partition(n, self.parts, self.rank, self.alignment)
                offsets.append(pos)
                if b > a:
                    slices.append(Slice(i, a, b, pos))
                pos += p
            set_("offsets", tuple(offsets))
            set_("size", pos)
            set_("slices", tuple(slices))
            return
        starts, pos = [], 0
        for n in numels:
            starts.append(pos)
            pos += n
        set_("offsets", tuple(starts))
        if self.stage == 0:
            set_("size", pos)
            set_("slices", tuple(Slice(i, 0, n, starts[i]) for i, n in enumerate(numels) if n))
            return
        size, entries = group_partition(numels, self.parts, self.rank, self.alignment)
        base = self.rank * size
        set_("size", size)
        set_("slices", tuple(Slice(i, a, b, starts[i] + a - base) for i, a, b in entries))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def total(self) -> int:
        """T: elements of the members together (unpadded)."""
        return sum(self.numels)

    @property
    def padded_total(self) -> int:
        """Stages 0-2: length of the full flat buffer, D·P (stage 0: T)."""
        return self.size * (self.parts if self.stage in (1, 2) else 1)

    def param_part_size(self, i: int) -> int:
        """Stage 3: p, the partition size of member ``i``."""
        return partition_size(self.numels[i], self.parts, self.alignment)

    def owner_slices(self, i: int) -> list[tuple[int, int, int, int]]:
        """Stages 1/2: ``(owner rank k, start, stop, offset in k's partition)`` for every partition member ``i`` touches."""
        n, start = self.numels[i], self.offsets[i]
        out = []
        for k in range(start // self.size if self.size else 0, self.parts):
            lo, hi = k * self.size, (k + 1) * self.size
            a, b = max(lo, start), min(hi, start + n)
            if a >= b:
                break
            out.append((k, a - start, b - start, a - lo))
        return out
