"""Planning the reads of many byte ranges of one file as few, large, aligned requests.

O_DIRECT moves whole aligned blocks between the disk and aligned memory. A range whose
memory is in phase with the file (address ≡ offset mod the alignment, as a save lays
pieces out) has an aligned middle that can land straight in the caller's memory; its
unaligned head and tail must go through a staging block. Read one range at a time, each
such range costs two small extra requests, and a load fills hundreds of tensors (malloc
hands out memory 64 bytes past a page): on a virtual disk, where a request costs about as
much time as a MiB of transfer, those small requests made a 2 GiB load a quarter slower.

The plan reads a run of consecutive ranges as contiguous requests of up to ``block_size``
bytes instead, each a vector of segments (``preadv``; ``IOCB_CMD_PREADV`` for libaio):
aligned middles straight into the caller's memory, the pages between them into one
staging block, copied out once the request completes. A page holding the tail of one
range and the head of the next is read once; a gap of up to ``max_gap`` bytes between
ranges is read and dropped rather than starting a new request.

Pure planning: nothing here touches a file (:mod:`aio.handle` submits the requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .buffers import address_of, round_down, round_up

MAX_GAP = 256 << 10  # unwanted bytes read to keep one request going; about one request's cost on a virtual disk
MIN_DIRECT = 64 << 10  # a smaller aligned middle is staged too: a copy this small costs less than a segment


@dataclass
class Segment:
    """``length`` bytes of a request, in file order: into ``dest`` (the caller's memory), or the staging block."""

    length: int
    dest: memoryview | None = None  # None: staged, at ``staged_at`` of the request's staging block
    staged_at: int = 0


@dataclass
class ReadRequest:
    """One contiguous, aligned read: ``segments`` cover ``[offset, offset + length)`` of the file."""

    offset: int
    segments: list[Segment] = field(default_factory=list)
    copies: list[tuple[int, memoryview]] = field(default_factory=list)  # (staged_at, dest): after the read
    length: int = 0
    staged: int = 0  # bytes of staging block the request needs
    need: int = 0  # bytes from ``offset`` that hold wanted data: a shorter read means the file ends too soon

    def buffers(self, staging: memoryview | None) -> list[memoryview]:
        """The request's vector: its segments as memory, staged ones placed in ``staging``."""
        out = []
        for s in self.segments:
            if s.dest is not None:
                out.append(s.dest)
            else:
                assert staging is not None
                out.append(staging[s.staged_at : s.staged_at + s.length])
        return out


def disjoint_runs(ranges: Sequence[tuple[int, memoryview]]) -> list[list[tuple[int, memoryview]]]:
    """Ranges sorted by offset, split into runs whose ranges do not overlap (each run is planned on its own:
    two ranges that want the same bytes cannot share one request's segments)."""
    runs: list[list[tuple[int, memoryview]]] = []
    ends: list[int] = []
    for offset, dest in sorted(ranges, key=lambda r: r[0]):
        if dest.nbytes == 0:
            continue
        for i, end in enumerate(ends):
            if offset >= end:
                runs[i].append((offset, dest))
                ends[i] = offset + dest.nbytes
                break
        else:
            runs.append([(offset, dest)])
            ends.append(offset + dest.nbytes)
    return runs


def plan_reads(
    ranges: Sequence[tuple[int, memoryview]],
    *,
    align: int,
    block_size: int,
    max_segments: int,
    max_gap: int = MAX_GAP,
    min_direct: int = MIN_DIRECT,
) -> list[ReadRequest]:
    """Requests that read every ``(offset, dest)`` range of one file into ``dest``.

    ``align``: 1 for a buffered file (every byte lands straight in ``dest``; nothing is staged), else
    the O_DIRECT alignment, which ``block_size`` must be a multiple of. ``max_segments``: the vector
    length the engine takes (1: one buffer per request). Overlapping ranges are planned in separate
    runs (:func:`disjoint_runs`), each filled as if alone.
    """
    if block_size % align:
        raise ValueError(f"block_size {block_size} is not a multiple of the alignment {align}")
    plan = _Plan(align, block_size, max(1, max_segments), max_gap if align > 1 else 0)
    for run in disjoint_runs(ranges):
        plan.cur = None  # a run never shares a request with another: their bytes overlap
        for offset, dest in run:
            for lo, hi, direct in _parts(offset, dest.nbytes, address_of(dest), align, min_direct):
                view = dest[lo - offset : hi - offset]
                if direct:
                    plan.direct(lo, view)
                else:
                    plan.staged(lo, view)
    return plan.requests


def _parts(offset: int, n: int, address: int, align: int, min_direct: int) -> list[tuple[int, int, bool]]:
    """``(lo, hi, direct)`` file spans of one range: an aligned middle straight into its memory when it
    is in phase with the file and large enough, the rest staged."""
    end = offset + n
    if align == 1:
        return [(offset, end, True)]
    if (offset - address) % align == 0:
        mid_lo, mid_hi = round_up(offset, align), round_down(end, align)
        if mid_hi - mid_lo >= max(min_direct, align):
            parts = [(offset, mid_lo, False)] if mid_lo > offset else []
            parts.append((mid_lo, mid_hi, True))
            if end > mid_hi:
                parts.append((mid_hi, end, False))
            return parts
    return [(offset, end, False)]


class _Plan:
    """Requests built in file order; ``pos`` is where the current request's next segment starts."""

    def __init__(self, align: int, block_size: int, max_segments: int, max_gap: int) -> None:
        self.align, self.block_size, self.max_segments, self.max_gap = align, block_size, max_segments, max_gap
        self.requests: list[ReadRequest] = []
        self.cur: ReadRequest | None = None

    @property
    def pos(self) -> int:
        assert self.cur is not None
        return self.cur.offset + self.cur.length

    def direct(self, lo: int, view: memoryview) -> None:
        """Aligned bytes ``[lo, lo + len(view))`` straight into ``view``."""
        self._go_to(lo)
        done = 0
        while done < view.nbytes:
            req = self._with_room(new_segment=True)
            take = min(view.nbytes - done, self.block_size - req.length)
            req.segments.append(Segment(take, view[done : done + take]))
            req.length += take
            req.need = req.length
            done += take

    def staged(self, lo: int, view: memoryview) -> None:
        """Bytes ``[lo, lo + len(view))`` through staging: the pages that hold them, read whole."""
        hi = lo + view.nbytes
        if self.cur is not None and round_down(lo, self.align) < self.pos:
            # The first page was staged for the previous range (its tail): copy from it, read it once.
            req, last = self.cur, self.cur.segments[-1]
            assert last.dest is None and lo >= self.pos - last.length, "a shared page must be the staged end"
            shared = min(hi, self.pos) - lo
            req.copies.append((req.staged - (self.pos - lo), view[:shared]))
            req.need = max(req.need, lo + shared - req.offset)
            if shared == view.nbytes:
                return
            view, lo = view[shared:], self.pos
        at, end = round_down(lo, self.align), round_up(hi, self.align)
        self._go_to(at)
        while at < end:
            assert self.cur is not None
            req = self._with_room(new_segment=not self._ends_staged(self.cur))
            take = min(end - at, self.block_size - req.length)
            staged_at = self._stage(req, take)
            a, b = max(lo, at), min(hi, at + take)
            if b > a:
                req.copies.append((staged_at + a - at, view[a - lo : b - lo]))
                req.need = max(req.need, b - req.offset)
            at += take

    def _go_to(self, at: int) -> None:
        """Make the current request end at file offset ``at`` (aligned): read a short gap, or start a new one."""
        if self.cur is not None:
            gap = at - self.pos
            if gap == 0:
                return
            req = self.cur
            fits = req.length + gap <= self.block_size and (
                self._ends_staged(req) or len(req.segments) < self.max_segments
            )
            if 0 < gap <= self.max_gap and fits:
                self._stage(req, gap)  # unwanted bytes: no copy
                return
        self._open(at)

    @staticmethod
    def _ends_staged(req: ReadRequest) -> bool:
        """Whether staged bytes added to ``req`` extend its last segment (else they need a new one)."""
        return bool(req.segments) and req.segments[-1].dest is None

    def _stage(self, req: ReadRequest, n: int) -> int:
        """Extend ``req`` by ``n`` staged bytes (merged into its last segment when that one is staged too);
        where they start in the staging block."""
        staged_at = req.staged
        if self._ends_staged(req):
            req.segments[-1].length += n
        else:
            req.segments.append(Segment(n, None, staged_at))
        req.staged += n
        req.length += n
        return staged_at

    def _with_room(self, *, new_segment: bool) -> ReadRequest:
        """The current request if it can take more bytes (and a new segment, if one is needed), else a new
        one starting where it ends."""
        req = self.cur
        assert req is not None
        if req.length >= self.block_size or (new_segment and len(req.segments) >= self.max_segments):
            req = self._open(self.pos)
        return req

    def _open(self, at: int) -> ReadRequest:
        self.cur = ReadRequest(at)
        self.requests.append(self.cur)
        return self.cur
