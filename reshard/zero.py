"""ZeRO partitions: flat ranges of TP-local tensors, and where they land in the global tensors.

Stages 1/2 cut a group's concatenated flat buffer into equal aligned partitions; stage 3 cuts
each parameter on its own (docs/patterns.md, section 4). Either way a rank ends up holding flat
ranges of TP-local tensors, which :func:`local_flat_to_global` maps to global regions through the
local tensor's box pairs.
"""

from __future__ import annotations

from typing import Sequence

from .box import Box, FlatRange, flat_index, flat_range_to_boxes, flat_span
from .runs import contiguous_boxes


def partition_size(numel: int, parts: int, alignment: int) -> int:
    """Elements per rank: ⌈numel/parts⌉ rounded up to a multiple of ``alignment``."""
    per = -(-numel // parts)
    return -(-per // alignment) * alignment


def group_partition(
    numels: Sequence[int], parts: int, index: int, alignment: int
) -> tuple[int, list[tuple[int, int, int]]]:
    """Stages 1/2: ``(partition size, [(param i, start, stop) within param i's flat local tensor, ...])``.

    The params are concatenated in order; rank ``index`` holds ``[index·P, (index+1)·P)`` of the padded buffer.
    Entries are listed in buffer order; empty intersections are left out.
    """
    size = partition_size(sum(numels), parts, alignment)
    lo, hi = index * size, (index + 1) * size
    out, pos = [], 0
    for i, n in enumerate(numels):
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((i, a - pos, b - pos))
        pos += n
    return size, out


def param_partition(numel: int, parts: int, index: int, alignment: int) -> tuple[int, int, int]:
    """Stage 3: ``(partition size, start, stop)`` of one param's flat local tensor held by rank ``index``."""
    size = partition_size(numel, parts, alignment)
    start = min(index * size, numel)
    return size, start, min(start + size, numel)


def local_flat_to_global(
    local_shape: Sequence[int], pairs: Sequence[tuple[Box, Box]], global_shape: Sequence[int], start: int, stop: int
) -> list[tuple[int, Box | FlatRange]]:
    """Map elements ``[start, stop)`` of a local tensor's flattening to global regions.

    ``pairs`` are the local tensor's ``(local box, global box)`` correspondences. Returns
    ``(offset from start, global region)`` in order; each region's elements sit contiguously at
    that offset in the same order. Elements no pair covers (padding) are skipped. Pieces that are
    contiguous in the global tensor too come back as (merged) flat ranges, the rest as boxes.
    """
    local_shape = tuple(local_shape)
    segs: list[tuple[int, Box]] = []
    for _, lbox in flat_range_to_boxes(start, stop, local_shape):
        for lb, gb in pairs:
            inter = lbox.intersect(lb)
            if inter is None:
                continue
            for sub in contiguous_boxes(inter, local_shape):
                g_off = tuple(s - l + o for s, l, o in zip(sub.offsets, lb.offsets, gb.offsets))
                segs.append((flat_index(local_shape, sub.offsets) - start, Box(g_off, sub.shape)))
    segs.sort(key=lambda t: t[0])
    out: list[tuple[int, Box | FlatRange]] = []
    for off, g in segs:
        lo, hi = flat_span(global_shape, g)
        region: Box | FlatRange = FlatRange(lo, hi) if hi - lo == g.numel else g
        if out and isinstance(region, FlatRange):
            prev_off, prev = out[-1]
            if isinstance(prev, FlatRange) and prev_off + prev.numel == off and prev.stop == region.start:
                out[-1] = (prev_off, FlatRange(prev.start, region.stop))
                continue
        out.append((off, region))
    return out
