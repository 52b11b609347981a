"""Copying the elements two regions of a tensor share, between their local buffers (torch views, no I/O).

A region's *buffer* is how a rank holds it: a box as a tensor of the box's shape,
a flat range as a 1-d tensor. Source buffers may be a partial span of a stored
piece (only the bytes a reader fetched), hence ``first``: the element of the
region's buffer that the given source tensor starts at.
"""

from __future__ import annotations

from typing import Sequence

import torch

from reshard.box import Box, FlatRange, flat_index, flat_span, transfers


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def source_view(flat: torch.Tensor, first: int, block: tuple[int, Box], box: Box) -> torch.Tensor:
    """``box`` (global coordinates) out of a contiguous 1-d tensor holding region elements from ``first``."""
    off, b = block
    rel = box.relative_to(b)
    start = off + flat_index(b.shape, rel.offsets) - first
    return flat.as_strided(rel.shape, row_major_strides(b.shape), flat.storage_offset() + start)


def target_view(buf: torch.Tensor, region: Box | FlatRange, block: tuple[int, Box], box: Box) -> torch.Tensor:
    """``box`` (global coordinates) inside a region's buffer (any strides)."""
    off, b = block
    rel = box.relative_to(b)
    if isinstance(region, Box):
        return buf[rel.slices()]
    return buf[off : off + b.numel].view(b.shape)[rel.slices()]


def copy_region(src: torch.Tensor, src_region: Box | FlatRange, first: int,
                dst: torch.Tensor, dst_region: Box | FlatRange, shape: Sequence[int]) -> int:
    """Copy every element ``dst_region`` wants from ``src_region`` (casting dtypes); returns elements copied.

    ``src`` is a contiguous 1-d tensor holding the source region's elements from ``first`` on.
    """
    n = 0
    for t in transfers(src_region, dst_region, shape):
        target_view(dst, dst_region, t.dst_block, t.box).copy_(source_view(src, first, t.src_block, t.box))
        n += t.box.numel
    return n


def as_flat_range(region: Box | FlatRange, shape: Sequence[int]) -> FlatRange | None:
    """The region as one contiguous flat range when it is one (for comparing layouts), else None."""
    if isinstance(region, FlatRange):
        return region
    lo, hi = flat_span(shape, region)
    return FlatRange(lo, hi) if hi - lo == region.numel else None


def same_elements(a: Box | FlatRange, b: Box | FlatRange, shape: Sequence[int]) -> bool:
    """Whether two regions hold the same elements in the same buffer order."""
    if isinstance(a, Box) and isinstance(b, Box):
        return a == b or (a.empty and b.empty)
    fa, fb = as_flat_range(a, shape), as_flat_range(b, shape)
    return fa is not None and fb is not None and (fa == fb or (fa.numel == 0 and fb.numel == 0))
