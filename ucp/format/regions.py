"""Copying the elements two regions of a tensor share, between their local buffers (views, no I/O).

A region's *buffer* is how a rank holds it: a box as a tensor of the box's shape,
a flat range as a 1-d tensor. Source buffers may be a partial span of a stored
piece (only the bytes a reader fetched), hence ``first``: the element of the
region's buffer that the given source tensor starts at.

Buffers are torch tensors (loads: any dtypes, cast on copy), :class:`RawArray` (``ucp reshape``,
``export`` and ``convert``, which move elements of one dtype as opaque fixed-size items and import
neither torch nor numpy) or numpy arrays of ``numpy.dtype("V<n>")`` items; both ends of one copy are
of the same kind.
"""

from __future__ import annotations

import itertools
import math
import mmap
import sys
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, Sequence

from reshard.box import Box, FlatRange, flat_index, flat_span, transfers

Buffer = Any  # torch.Tensor | RawArray | numpy.ndarray

# A RawArray copy is a run of contiguous bytes per row of the box; rows are copied one by one (a memoryview
# slice assignment each) while there are few of them or they are long, else numpy does the strided copy
# (imported then: a TP column split of many short rows, where a Python loop would cost more than numpy).
FEW_RUNS = 64
LONG_RUN_BYTES = 16 << 10
# RawArray.empty maps memory this large (page-aligned, faulted in as it is filled) rather than zero it.
MAP_MIN_BYTES = 1 << 20


@dataclass(frozen=True, eq=False)
class RawArray:
    """An N-d array of opaque ``itemsize``-byte elements in C order over a byte buffer (``data``: a ``'B'``
    memoryview of exactly ``numel * itemsize`` bytes): what byte-moving paths read into and copy between,
    needing neither torch nor numpy. Views of the same memory keep it alive (and a
    :class:`ucp.store.reader.MemoryPool` mapping in use) as any memoryview does."""

    data: memoryview
    shape: tuple[int, ...]
    itemsize: int

    def __post_init__(self) -> None:
        if self.data.format != "B" or self.data.ndim != 1:
            object.__setattr__(self, "data", self.data.cast("B"))  # contiguous memory, as bytes
        if self.data.nbytes != math.prod(self.shape) * self.itemsize:
            raise ValueError(
                f"a raw array of shape {list(self.shape)} and {self.itemsize}-byte items needs "
                f"{math.prod(self.shape) * self.itemsize} bytes, not {self.data.nbytes}"
            )

    @classmethod
    def empty(cls, shape: Sequence[int], itemsize: int) -> "RawArray":
        """A new array (contents unspecified: zeros); large ones in page-aligned memory of their own."""
        nbytes = math.prod(shape) * itemsize
        memory: Any = mmap.mmap(-1, nbytes) if nbytes >= MAP_MIN_BYTES else bytearray(nbytes)
        return cls(memoryview(memory), tuple(int(d) for d in shape), itemsize)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def readonly(self) -> bool:
        return self.data.readonly

    def reshape(self, shape: Sequence[int]) -> "RawArray":
        """The same memory with another shape of as many elements."""
        return RawArray(self.data, tuple(int(d) for d in shape), self.itemsize)

    def tobytes(self) -> bytes:
        return self.data.tobytes()

    def numpy(self) -> Any:
        """The same memory as a numpy array of ``V<itemsize>`` items (imports numpy)."""
        import numpy as np

        return np.frombuffer(self.data, dtype=np.dtype(f"V{self.itemsize}")).reshape(self.shape)


def is_numpy(buf: Any) -> bool:
    """Whether ``buf`` is a numpy array (without importing numpy: none exists before it is imported)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(buf, np.ndarray)


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
    if is_numpy(flat):
        import numpy as np

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
    return (flat.reshape(b.shape) if is_numpy(flat) else flat.view(b.shape))[index]


def copy_region(
    src: Buffer, src_region: Box | FlatRange, first: int, dst: Buffer, dst_region: Box | FlatRange, shape: Sequence[int]
) -> int:
    """Copy every element ``dst_region`` wants from ``src_region`` (casting dtypes); returns elements copied.

    ``src`` is a contiguous 1-d buffer holding the source region's elements from ``first`` on.
    """
    n = 0
    for t in transfers(src_region, dst_region, shape):
        if isinstance(dst, RawArray):
            _copy_raw(src, first, t.src_block, dst, t.dst_block, t.box)
            n += t.box.numel
            continue
        into, values = target_view(dst, dst_region, t.dst_block, t.box), source_view(src, first, t.src_block, t.box)
        if is_numpy(into):
            import numpy as np

            np.copyto(into, values, casting="no")
        else:
            into.copy_(values)
        n += t.box.numel
    return n


def _copy_raw(
    src: RawArray, first: int, src_block: tuple[int, Box], dst: RawArray, dst_block: tuple[int, Box], box: Box
) -> None:
    """Copy ``box`` (global coordinates) between two raw buffers: row by row, or by numpy when the rows are
    many and short (see :data:`FEW_RUNS`). ``src`` is 1-d, holding its region's elements from ``first``."""
    if not isinstance(src, RawArray) or src.itemsize != dst.itemsize:
        raise TypeError("a raw array copies from a raw array of the same item size")
    if box.numel == 0:
        return
    (s_off, s_block), (d_off, d_block) = src_block, dst_block
    s_rel, d_rel = box.relative_to(s_block), box.relative_to(d_block)
    s_strides, d_strides = row_major_strides(s_block.shape), row_major_strides(d_block.shape)
    s0 = s_off + flat_index(s_block.shape, s_rel.offsets) - first
    d0 = d_off + flat_index(d_block.shape, d_rel.offsets)
    dims = tuple(box.shape)
    s_last = s0 + sum((k - 1) * st for k, st in zip(dims, s_strides))
    if not (0 <= s0 and s_last < src.numel):  # as numpy's as_strided would not check
        raise ValueError(
            f"box {s_rel} of block {s_block} (elements {s0}..{s_last}) is outside a buffer of {src.numel} elements"
        )
    # The rows: trailing dimensions the box spans whole in both blocks are contiguous in both buffers.
    j = max(len(dims) - 1, 0)
    while j > 0 and dims[j] == s_block.shape[j] == d_block.shape[j]:
        j -= 1
    run = math.prod(dims[j:]) * src.itemsize
    rows = math.prod(dims[:j])
    if rows > FEW_RUNS and run < LONG_RUN_BYTES:
        import numpy as np

        into = target_view(dst.numpy().reshape(-1), FlatRange(0, dst.numel), dst_block, box)
        np.copyto(into, source_view(src.numpy(), first, src_block, box), casting="no")
        return
    size = src.itemsize
    s_data, d_data = src.data, dst.data
    for index in itertools.product(*(range(k) for k in dims[:j])):
        s = (s0 + sum(i * st for i, st in zip(index, s_strides))) * size
        d = (d0 + sum(i * st for i, st in zip(index, d_strides))) * size
        d_data[d : d + run] = s_data[s : s + run]


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
