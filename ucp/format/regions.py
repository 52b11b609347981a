"""Copying the elements two regions of a tensor share, between their local buffers (views, no I/O).

A region's *buffer* is how a rank holds it: a box as a tensor of the box's shape,
a flat range as a 1-d tensor. Source buffers may be a partial span of a stored
piece (only the bytes a reader fetched), hence ``first``: the element of the
region's buffer that the given source tensor starts at.

Buffers are torch tensors (loads: any dtypes, cast on copy) or numpy arrays (``ucp reshape``,
which moves elements of one dtype as opaque fixed-size items and never imports torch); both
ends of one copy are of the same kind.
"""

from __future__ import annotations

from types import EllipsisType
from typing import Any, Sequence

import numpy as np

from reshard.box import Box, FlatRange, flat_index, flat_span, transfers

Buffer = Any  # torch.Tensor | numpy.ndarray


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def source_view(flat: Buffer, first: int, block: tuple[int, Box], box: Box) -> Buffer:
    """``box`` (global coordinates) out of a contiguous 1-d buffer holding region elements from ``first``."""
    off, b = block
    rel = box.relative_to(b)
    start = off + flat_index(b.shape, rel.offsets) - first
    strides = row_major_strides(b.shape)
    if isinstance(flat, np.ndarray):
        # as_strided checks nothing (torch's does): make sure the box lies inside the buffer.
        last = start + sum((n - 1) * st for n, st in zip(rel.shape, strides))
        if rel.numel and not (0 <= start and last < flat.shape[0]):
            raise ValueError(
                f"box {rel} of block {b} (elements {start}..{last}) is outside a buffer of {flat.shape[0]} elements"
            )
        return np.lib.stride_tricks.as_strided(
            flat[max(start, 0) :], rel.shape, [s * flat.itemsize for s in strides], writeable=False
        )
    return flat.as_strided(rel.shape, strides, flat.storage_offset() + start)


def target_view(buf: Buffer, region: Box | FlatRange, block: tuple[int, Box], box: Box) -> Buffer:
    """``box`` (global coordinates) inside a region's buffer (any strides)."""
    off, b = block
    rel = box.relative_to(b)
    # The trailing Ellipsis keeps a 0-d numpy box an array view (``a[()]`` would be a scalar copy).
    index: tuple[slice | EllipsisType, ...] = (*rel.slices(), Ellipsis)
    if isinstance(region, Box):
        return buf[index]
    flat = buf[off : off + b.numel]
    return (flat.reshape(b.shape) if isinstance(flat, np.ndarray) else flat.view(b.shape))[index]


def copy_region(
    src: Buffer, src_region: Box | FlatRange, first: int, dst: Buffer, dst_region: Box | FlatRange, shape: Sequence[int]
) -> int:
    """Copy every element ``dst_region`` wants from ``src_region`` (casting dtypes); returns elements copied.

    ``src`` is a contiguous 1-d buffer holding the source region's elements from ``first`` on.
    """
    n = 0
    for t in transfers(src_region, dst_region, shape):
        into, values = target_view(dst, dst_region, t.dst_block, t.box), source_view(src, first, t.src_block, t.box)
        if isinstance(into, np.ndarray):
            np.copyto(into, values, casting="no")
        else:
            into.copy_(values)
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
