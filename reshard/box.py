"""N-d box and flat-range arithmetic for moving pieces of tensors between layouts.

A saved tensor is stored as pieces, each either an N-d *box* (a sub-array
``[offsets, offsets + shape)``) or a *flat range* ``[start, stop)`` of the
row-major flattened tensor (ZeRO-style partitions). Loading into another
layout means intersecting regions. To treat both kinds alike, a flat range is
decomposed into at most ``2·ndim - 1`` boxes that are each contiguous in
row-major order (:func:`flat_range_to_boxes`); then everything is box ∩ box.

Pure integer math: no tensors, no I/O.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Box:
    """The sub-array ``[offsets, offsets + shape)`` of an N-d array."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"box offsets {self.offsets} and shape {self.shape} differ in rank")

    @classmethod
    def of(cls, offsets: Sequence[int], shape: Sequence[int]) -> "Box":
        return cls(tuple(int(o) for o in offsets), tuple(int(s) for s in shape))

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        """The box covering a whole array of ``shape``."""
        return cls((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def empty(self) -> bool:
        return self.numel == 0

    def intersect(self, other: "Box") -> "Box | None":
        """The common part of two boxes of the same array, or None when it is empty."""
        if self.ndim != other.ndim:
            raise ValueError(f"cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(h <= l for l, h in zip(lo, hi)) or self.empty or other.empty:
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def contains(self, other: "Box") -> bool:
        return all(a <= b for a, b in zip(self.offsets, other.offsets)) and all(
            a >= b for a, b in zip(self.stop, other.stop)
        )

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the box lies inside an array of ``shape`` (non-negative, not past the end)."""
        return (
            len(shape) == self.ndim
            and all(o >= 0 and s >= 0 for o, s in zip(self.offsets, self.shape))
            and all(e <= d for e, d in zip(self.stop, shape))
        )

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of ``outer`` (whose origin becomes zero)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets)), self.shape)

    def slices(self) -> tuple[slice, ...]:
        """Index that selects this box from an array (``array[box.slices()]``)."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))


def flat_index(shape: Sequence[int], index: Sequence[int]) -> int:
    """Row-major position of ``index`` in an array of ``shape``."""
    pos = 0
    for dim, i in zip(shape, index):
        pos = pos * dim + i
    return pos


def unflatten_index(shape: Sequence[int], pos: int) -> tuple[int, ...]:
    """Inverse of :func:`flat_index`."""
    out = []
    for dim in reversed(shape):
        if dim == 0:
            out.append(0)
            continue
        pos, r = divmod(pos, dim)
        out.append(r)
    return tuple(reversed(out))


def flat_span(shape: Sequence[int], box: Box) -> tuple[int, int]:
    """The smallest row-major element range ``[first, last + 1)`` of an array of ``shape`` holding ``box``.

    Reading this span is how a reader fetches just the bytes of a sub-box of a stored piece.
    Empty boxes give ``(0, 0)``.
    """
    if box.empty:
        return (0, 0)
    first = flat_index(shape, box.offsets)
    last = flat_index(shape, tuple(s - 1 for s in box.stop))
    return (first, last + 1)


def flat_range_to_boxes(start: int, stop: int, shape: Sequence[int]) -> list[tuple[int, Box]]:
    """Split elements ``[start, stop)`` of a row-major array into boxes, each contiguous in memory.

    Returns ``(first element, box)`` pairs in order; their boxes together hold exactly the range.
    Each box has the form (1, ..., 1, k, full, ..., full), which is why it is contiguous.
    """
    shape = tuple(int(d) for d in shape)
    if start >= stop:
        return []
    if not shape:  # a 0-d array has the single element 0
        return [(0, Box((), ()))]
    out: list[tuple[int, Box]] = []
    _split(start, stop, shape, 0, (), out, 0)
    return out


def _split(
    start: int, stop: int, shape: tuple[int, ...], dim: int, prefix: tuple[int, ...], out: list, base: int
) -> None:
    """Recursive helper: cover [start, stop) of the sub-array ``shape[dim:]`` selected by ``prefix``."""
    inner = math.prod(shape[dim + 1 :])  # elements per index of this dimension
    rest = len(shape) - dim - 1
    if inner == 0:
        return
    lo_i, lo_r = divmod(start, inner)
    hi_i, hi_r = divmod(stop, inner)
    if lo_r:  # a partial first slab: recurse into it
        end = stop - lo_i * inner if hi_i == lo_i else inner
        _split(lo_r, end, shape, dim + 1, prefix + (lo_i,), out, base + lo_i * inner)
        if hi_i == lo_i:
            return
        lo_i += 1
    if hi_i > lo_i:  # whole slabs in the middle: one box
        box = Box(prefix + (lo_i,) + (0,) * rest, (1,) * len(prefix) + (hi_i - lo_i,) + shape[dim + 1 :])
        out.append((base + lo_i * inner, box))
    if hi_r:  # a partial last slab
        _split(0, hi_r, shape, dim + 1, prefix + (hi_i,), out, base + hi_i * inner)


def intersect_ranges(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Intersection of two half-open ranges, or None when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


# -- regions: what a piece (stored or wanted) occupies --------------------------------------------


@dataclass(frozen=True)
class FlatRange:
    """Elements ``[start, stop)`` of the row-major flattened array."""

    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


Region = Box | FlatRange


def region_blocks(region: Region, shape: Sequence[int]) -> list[tuple[int, Box]]:
    """The region as ``(element offset within the region's own buffer, box)`` blocks.

    A box region is one block whose buffer is the box itself in row-major order; a flat
    range is its contiguous boxes, each at its offset in the 1-d buffer.
    """
    if isinstance(region, Box):
        return [] if region.empty else [(0, region)]
    return [(first - region.start, box) for first, box in flat_range_to_boxes(region.start, region.stop, shape)]


def split_region(region: Region, itemsize: int, max_bytes: int) -> list[tuple[int, Region]]:
    """``region`` cut into consecutive parts of at most ``max_bytes`` each, in its buffer's order.

    Returns ``(element offset of the part in the region's buffer, part)``. Parts of a box are boxes
    each contiguous in the box's row-major order (slabs along the first dimension whose trailing
    block fits, that block cut further when even one of it is too large); parts of a flat range
    are flat ranges. A part holds at least one element, so a single element larger than
    ``max_bytes`` is a part of its own. Lets a writer move a huge piece through bounded memory.
    """
    n_max = max(1, max_bytes // max(itemsize, 1))
    if region.numel <= n_max:
        return [(0, region)]
    if isinstance(region, FlatRange):
        return [
            (a - region.start, FlatRange(a, min(a + n_max, region.stop)))
            for a in range(region.start, region.stop, n_max)
        ]
    shape = region.shape
    k = next(d for d in range(len(shape)) if math.prod(shape[d + 1 :]) <= n_max)  # the last dim always fits
    inner = math.prod(shape[k + 1 :])
    step = max(1, n_max // max(inner, 1))
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    out: list[tuple[int, Region]] = []
    for prefix in itertools.product(*(range(n) for n in shape[:k])):
        for j in range(0, shape[k], step):
            index = (*prefix, j) + (0,) * (len(shape) - k - 1)
            offsets = tuple(o + i for o, i in zip(region.offsets, index))
            part_shape = (1,) * k + (min(step, shape[k] - j),) + tuple(shape[k + 1 :])
            out.append((sum(i * s for i, s in zip(index, strides)), Box(offsets, part_shape)))
    return out


@dataclass(frozen=True)
class Transfer:
    """Copy ``box`` (global coordinates) from one region's buffer to another's.

    ``src_block``/``dst_block`` are the blocks (offset into the region's buffer, block box) that hold
    ``box``; the data is ``buffer[offset : offset + block.numel].reshape(block.shape)[box relative to block]``.
    """

    box: Box
    src_block: tuple[int, Box]
    dst_block: tuple[int, Box]


def transfers(src: Region, dst: Region, shape: Sequence[int]) -> list[Transfer]:
    """Every box of the global array that ``src`` holds and ``dst`` wants, with where it lives in each."""
    out = []
    dst_blocks = region_blocks(dst, shape)
    for sb in region_blocks(src, shape):
        for db in dst_blocks:
            inter = sb[1].intersect(db[1])
            if inter is not None:
                out.append(Transfer(inter, sb, db))
    return out


def element_span(region: Region, shape: Sequence[int], box: Box) -> tuple[int, int]:
    """Elements ``[first, stop)`` of ``region``'s own buffer holding all of ``box`` (inside the region)."""
    first, stop = None, None
    for off, block in region_blocks(region, shape):
        inter = block.intersect(box)
        if inter is None:
            continue
        lo, hi = flat_span(block.shape, inter.relative_to(block))
        lo, hi = lo + off, hi + off
        first = lo if first is None else min(first, lo)
        stop = hi if stop is None else max(stop, hi)
    return (0, 0) if first is None else (first, stop)  # type: ignore[return-value]


def region_boxes(region: Region, shape: Sequence[int]) -> list[Box]:
    return [b for _, b in region_blocks(region, shape)]


# The exact-cover check lists 2**d signed corners per piece (d: the dimensions the pieces split);
# past this many it falls back to a sweep. Naming two overlapping pieces compares at most
# OVERLAP_BUDGET pairs, so a hostile piece list costs seconds, not hours.
CORNER_BUDGET = 1 << 22
OVERLAP_BUDGET = 1 << 20


def check_exact_cover(
    regions: Sequence[Region], shape: Sequence[int], labels: Sequence[str] | None = None
) -> str | None:
    """Why ``regions`` do not tile an array of ``shape`` exactly once, or None when they do.

    Every region must lie inside the array, no two may share an element, and together they
    must hold every element. The test is linear in the number of pieces (:func:`_tiles`); only
    when it fails is a sweep run to name two overlapping pieces, and that sweep gives up after
    ``OVERLAP_BUDGET`` comparisons, saying what it knows. ``labels`` name the regions in the
    answer (e.g. with the file holding each); by default "piece <index>".
    """
    shape = tuple(shape)
    total = math.prod(shape)
    covered = 0
    boxes: list[tuple[Box, int]] = []

    def label(i: int) -> str:
        return labels[i] if labels is not None else f"piece {i}"

    for i, region in enumerate(regions):
        if isinstance(region, Box):
            if not region.within(shape):
                return f"{label(i)} box {list(region.offsets)}+{list(region.shape)} lies outside shape {list(shape)}"
        elif not (0 <= region.start <= region.stop <= total):
            return f"{label(i)} flat range [{region.start}, {region.stop}) lies outside [0, {total})"
        covered += region.numel
        boxes.extend((b, i) for b in region_boxes(region, shape))
    exact = _tiles([b for b, _ in boxes], shape)
    if exact:
        return None
    overlap = _find_overlap(boxes, OVERLAP_BUDGET)
    if isinstance(overlap, tuple):
        if labels is None:
            return f"pieces {overlap[0]} and {overlap[1]} overlap"
        return f"{label(overlap[0])} and {label(overlap[1])} overlap"
    if covered != total:
        return f"pieces cover {covered} of {total} elements"
    if overlap is None:  # no overlap and every element's count: an exact cover (known now if _tiles could not say)
        return None
    if exact is None:
        return f"{len(regions)} pieces split too many dimensions to check that they cover the tensor exactly once"
    return f"pieces overlap: {len(regions)} pieces hold {covered} elements but not each of the {total} once"


def _tiles(boxes: Sequence[Box], shape: tuple[int, ...]) -> bool | None:
    """Do ``boxes`` (inside ``shape``) hold every element exactly once? None: too many corners to tell.

    The indicator of a box ``[a, b)`` is a signed sum of orthant indicators at its 2**d corners
    (``+`` at a corner with an even number of ``b`` coordinates, ``-`` at odd), and orthant
    indicators at distinct points are linearly independent. So the boxes tile the array exactly
    when their signed corners, summed point by point, equal the array's own. Dimensions that
    every box spans whole drop out first, leaving d small for real layouts (rows, grids).
    """
    ndim = len(shape)
    live = [(b.offsets, b.shape) for b in boxes if 0 not in b.shape]  # empty boxes hold nothing
    dims = [d for d in range(ndim) if any(o[d] != 0 or n[d] != shape[d] for o, n in live)]
    if (len(live) + 1) << len(dims) > CORNER_BUDGET:
        return None
    signs = [(-1) ** bin(k).count("1") for k in range(1 << len(dims))]  # k's set bits: the corner's b's
    weights: dict[tuple[int, ...], int] = {}
    get = weights.get
    for o, n in live:
        for sign, point in zip(signs, itertools.product(*[(o[d], o[d] + n[d]) for d in dims])):
            weights[point] = get(point, 0) + sign
    for sign, point in zip(signs, itertools.product(*[(0, shape[d]) for d in dims])):  # minus the array's own
        weights[point] = get(point, 0) - sign
    return not any(weights.values())


def _find_overlap(boxes: Iterable[tuple[Box, int]], budget: int) -> tuple[int, int] | None | bool:
    """Indices of two overlapping boxes; None when there are none; False when ``budget``
    comparisons did not settle it.

    A sweep along the most finely split dimension. The boxes the sweep line crosses are kept
    sorted by where they start along the next most finely split one, so a box is compared only
    with those whose span there can reach it: about one per box for grids and row layouts.
    """
    items = [b for b in boxes if not b[0].empty]
    if not items:
        return None
    ndim = items[0][0].ndim
    if ndim == 0:
        return (items[0][1], items[1][1]) if len(items) > 1 else None
    ranked = sorted(range(ndim), key=lambda d: -len({b.offsets[d] for b, _ in items}))
    dim, dim2 = ranked[0], ranked[min(1, ndim - 1)]
    items.sort(key=lambda t: t[0].offsets[dim])
    reach = max(b.shape[dim2] for b, _ in items)  # a box starting further back along dim2 ends before
    keys: list[tuple[int, int]] = []  # (start along dim2, sequence number) of the boxes crossing the line
    crossing: dict[tuple[int, int], tuple[Box, int]] = {}
    ends: list[tuple[int, tuple[int, int]]] = []  # heap: (end along dim, key)
    for seq, (box, idx) in enumerate(items):
        at = box.offsets[dim]
        while ends and ends[0][0] <= at:
            key = heapq.heappop(ends)[1]
            del keys[bisect.bisect_left(keys, key)]
            del crossing[key]
        lo, hi = box.offsets[dim2], box.offsets[dim2] + box.shape[dim2]
        first, last = bisect.bisect_left(keys, (lo - reach + 1, -1)), bisect.bisect_left(keys, (hi, -1))
        budget -= last - first + 1
        if budget < 0:
            return False
        for key in keys[first:last]:
            other, oidx = crossing[key]
            if other.intersect(box) is not None:
                return (min(oidx, idx), max(oidx, idx))
        key = (lo, seq)
        bisect.insort(keys, key)
        crossing[key] = (box, idx)
        heapq.heappush(ends, (at + box.shape[dim], key))
    return None
