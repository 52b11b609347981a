"""The load planner: which byte runs of which stored files fill which elements of target buffers.

Pure: sources are described (file, byte offset, global region, item size), never read. The plan
is a list of copies, each one contiguous run of file bytes into one contiguous run of a target
buffer's elements, sorted and coalesced, plus the target elements nothing fills (padding, to be
zeroed). Whoever executes it (ucp's reader) chooses how to batch the reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from .box import Box, FlatRange, check_exact_cover, flat_index, flat_span, transfers
from .errors import PlanError
from .layout import Layout
from .resolve import LocalBuffer, Resolver, Slot, state_name, state_shapes
from .runs import Affine, row_major_strides, runs

Region = Box | FlatRange


@dataclass(frozen=True)
class SourcePiece:
    """A stored piece of a global tensor: ``region``'s elements, row-major, from byte ``offset`` of ``file``.

    The same information as a manifest piece; defined here because reshard sits below ucp.
    """

    file: str
    offset: int
    region: Region
    itemsize: int


@dataclass(frozen=True)
class Copy:
    """Copy bytes ``[offset, offset + nbytes)`` of ``file`` into elements ``[start, start + count)`` of buffer ``target``."""

    file: str
    offset: int
    nbytes: int
    target: str
    start: int
    count: int


@dataclass(frozen=True)
class Fill:
    """Elements ``[start, start + count)`` of buffer ``target`` hold no stored data (padding): zero them."""

    target: str
    start: int
    count: int


@dataclass
class Plan:
    """Copies sorted by (target, start), coalesced; fills; and the shape of every target buffer."""

    copies: list[Copy] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes read from storage."""
        return sum(c.nbytes for c in self.copies)

    def read_ranges(self, gap: int = 0) -> dict[str, list[tuple[int, int]]]:
        """Per file, the byte ranges to read, sorted, merging ranges at most ``gap`` bytes apart."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for c in self.copies:
            by_file.setdefault(c.file, []).append((c.offset, c.offset + c.nbytes))
        out = {}
        for f, ranges in by_file.items():
            ranges.sort()
            merged = [ranges[0]]
            for lo, hi in ranges[1:]:
                if lo <= merged[-1][1] + gap:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
                else:
                    merged.append((lo, hi))
            out[f] = merged
        return out


class CheckedSources(dict):
    """Source pieces by tensor, already checked by :func:`check_sources`: plan many ranks, check once."""


def check_sources(sources: Mapping[str, Sequence[SourcePiece]], shapes: Mapping[str, Sequence[int]]) -> CheckedSources:
    """Check every tensor's pieces once (see :func:`checked_sources`), for planning many targets."""
    out = CheckedSources()
    for name, pieces in sources.items():
        if name not in shapes:
            raise PlanError(f"source pieces of tensor {name!r}, whose shape is not given")
        out[name] = checked_sources(name, pieces, tuple(shapes[name]))
    return out


def checked_sources(name: str, pieces: Sequence[SourcePiece], shape: Sequence[int]) -> list[SourcePiece]:
    """The pieces of one tensor, exact duplicates (replicas) dropped; PlanError unless they tile it exactly once."""
    seen: set[Region] = set()
    out = []
    for p in pieces:
        if p.itemsize < 1 or p.offset < 0:
            raise PlanError(f"tensor {name!r}: source piece in {p.file!r} at {p.offset} has itemsize {p.itemsize}")
        if p.region not in seen:
            seen.add(p.region)
            out.append(p)
    why = check_exact_cover([p.region for p in out], shape)
    if why is not None:
        raise PlanError(f"tensor {name!r} {list(shape)}: the source pieces do not tile it exactly once: {why}")
    return out


def _dst_affine(buf: LocalBuffer, slot: Slot, block: tuple[int, Box]) -> Affine:
    """Where the elements of one block of ``slot.glob`` sit in the buffer's flattening."""
    off, b = block
    if isinstance(slot.local, Box):
        return Affine(flat_index(buf.shape, slot.local.offsets), slot.glob.offsets, row_major_strides(buf.shape))  # type: ignore[union-attr]
    return Affine(slot.local.start + off, b.offsets, row_major_strides(b.shape))


def _check_slot(buf: LocalBuffer, slot: Slot, shape: Sequence[int]) -> None:
    where = f"buffer {buf.name!r} slot for tensor {slot.tensor!r}"
    if slot.local.numel != slot.glob.numel:
        raise PlanError(f"{where}: local region has {slot.local.numel} elements, global region {slot.glob.numel}")
    if isinstance(slot.local, Box):
        if not isinstance(slot.glob, Box) or slot.local.shape != slot.glob.shape:
            raise PlanError(f"{where}: a local box must map to a global box of the same shape")
        if not slot.local.within(buf.shape):
            raise PlanError(f"{where}: local box lies outside the buffer's shape {list(buf.shape)}")
    elif not 0 <= slot.local.start <= slot.local.stop <= buf.numel:
        raise PlanError(f"{where}: local range lies outside the buffer's {buf.numel} elements")
    if isinstance(slot.glob, Box):
        if not slot.glob.within(shape):
            raise PlanError(f"{where}: global box lies outside the tensor's shape {list(shape)}")
    elif not 0 <= slot.glob.start <= slot.glob.stop <= math.prod(shape):
        raise PlanError(f"{where}: global range lies outside the tensor's {math.prod(shape)} elements")


def plan(
    buffers: Sequence[LocalBuffer], sources: Mapping[str, Sequence[SourcePiece]], shapes: Mapping[str, Sequence[int]]
) -> Plan:
    """Plan filling ``buffers`` (one rank's targets) from stored ``sources`` of tensors of global ``shapes``.

    ``sources`` may come from :func:`check_sources` (checked once for many plans) or be plain lists.
    """
    out = Plan()
    checked: dict[str, list[SourcePiece]] = dict(sources) if isinstance(sources, CheckedSources) else {}
    raw: list[Copy] = []
    for buf in buffers:
        if buf.name in out.shapes:
            raise PlanError(f"two target buffers are named {buf.name!r}")
        out.shapes[buf.name] = tuple(buf.shape)
        for slot in buf.slots:
            if slot.tensor not in shapes:
                raise PlanError(f"buffer {buf.name!r} wants tensor {slot.tensor!r}, whose shape is not given")
            shape = tuple(shapes[slot.tensor])
            _check_slot(buf, slot, shape)
            if slot.tensor not in checked:
                if slot.tensor not in sources:
                    raise PlanError(f"buffer {buf.name!r} wants tensor {slot.tensor!r}, which the sources lack")
                checked[slot.tensor] = checked_sources(slot.tensor, sources[slot.tensor], shape)
            lo, hi = _span(slot.glob, shape)
            for piece in checked[slot.tensor]:
                p_lo, p_hi = _span(piece.region, shape)
                if p_hi <= lo or hi <= p_lo:  # cheap rejection before intersecting boxes
                    continue
                for t in transfers(piece.region, slot.glob, shape):
                    s_off, sb = t.src_block
                    src = Affine(s_off, sb.offsets, row_major_strides(sb.shape))
                    dst = _dst_affine(buf, slot, t.dst_block)
                    for s, d, n in runs(t.box, src, dst):
                        raw.append(
                            Copy(piece.file, piece.offset + s * piece.itemsize, n * piece.itemsize, buf.name, d, n)
                        )
    out.copies = _coalesce(raw)
    out.fills = _fills(out.copies, out.shapes)
    return out


def _span(region: Region, shape: Sequence[int]) -> tuple[int, int]:
    """The row-major element range enclosing a region."""
    if isinstance(region, FlatRange):
        return region.start, region.stop
    return flat_span(shape, region)


def _coalesce(copies: list[Copy]) -> list[Copy]:
    """Sort by target position, refuse double writes, merge runs contiguous on both sides."""
    copies.sort(key=lambda c: (c.target, c.start))
    merged: list[Copy] = []
    for c in copies:
        if merged and merged[-1].target == c.target:
            prev = merged[-1]
            if c.start < prev.start + prev.count:
                raise PlanError(f"buffer {c.target!r}: elements from {c.start} are written twice (overlapping slots)")
            if (
                prev.file == c.file
                and prev.offset + prev.nbytes == c.offset
                and prev.start + prev.count == c.start
                and prev.nbytes * c.count == c.nbytes * prev.count
            ):
                merged[-1] = Copy(
                    prev.file, prev.offset, prev.nbytes + c.nbytes, prev.target, prev.start, prev.count + c.count
                )
                continue
        merged.append(c)
    return merged


def _fills(copies: list[Copy], shapes: Mapping[str, tuple[int, ...]]) -> list[Fill]:
    """Every target range no copy writes."""
    pos: dict[str, int] = {name: 0 for name in shapes}
    fills: list[Fill] = []
    for c in copies:
        if c.start > pos[c.target]:
            fills.append(Fill(c.target, pos[c.target], c.start - pos[c.target]))
        pos[c.target] = c.start + c.count
    for name, shape in shapes.items():
        total = 1
        for d in shape:
            total *= d
        if pos[name] < total:
            fills.append(Fill(name, pos[name], total - pos[name]))
    fills.sort(key=lambda f: (f.target, f.start))
    return fills


def plan_layout(
    layout: Layout,
    shapes: Mapping[str, Sequence[int]],
    sources: Mapping[str, Sequence[SourcePiece]],
    states: Sequence[str] = (),
    name: Callable[[str, str], str] = state_name,
) -> dict[int, Plan]:
    """A plan for every rank of ``layout`` (by rank number): its weights and the optimizer ``states`` named."""
    res = Resolver(layout, shapes)
    every = {n: tuple(s) for n, s in shapes.items()}
    for key in states:
        every |= state_shapes(shapes, key, name)
    checked = check_sources({n: p for n, p in sources.items() if n in every}, every)
    out = {}
    for coord in layout.mesh.coords():
        view = res.view(coord)
        bufs = view.weights() + [b for key in states for b in view.optimizer_state(key, name)]
        out[view.rank] = plan(bufs, checked, every)
    return out
