"""What a background writer writes from: a staging arena the snapshot fills (:class:`Progress` says how
far) or, in-process, the caller's tensors themselves (:class:`DirectImage`)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ucp.errors import SnapshotAborted
from ucp.format.manifest import Piece
from ucp.saving.background.job import PlanSpec
from ucp.saving.plan import PlannedPiece, SavePlan
from ucp.saving.staging import Arena
from ucp.store.file_ranges import RangeReader
from ucp.store.storage import Storage
from ucp.store.writer import CrcChain, PieceBytes, StreamedParts, write_rank_file

if TYPE_CHECKING:
    from ucp.saving.snapshot import ChangeWatch

log = logging.getLogger(__name__)


@dataclass
class DirectImage:
    """In-process writes only: the rank file is written straight from the caller's tensors (byte views in
    plan order), with no staging copy. ``written`` resolves once the data file is durable (or the job
    failed): until then the caller must not change the tensors."""

    plan: SavePlan
    views: "Sequence[PieceBytes]"  # a StreamedShard's parts are pulled as the file is written
    watch: "ChangeWatch | None" = None  # checked once the file is written, before the commit

    written: Future = field(default_factory=Future)

    def check_unchanged(self) -> None:
        """Raise SnapshotChangedError if the caller changed a tensor before the data file was written."""
        if self.watch is not None:
            self.watch.check_all()

    def finished(self) -> None:
        self.views = []
        if self.watch is not None:
            self.watch.release()
        if not self.written.done():
            self.written.set_result(None)


class Progress:
    """How many bytes of an arena image are filled: the snapshot advances it, the writer waits on it.

    CUDA pieces are copied asynchronously; :meth:`complete_after` leaves their
    events with the progress, and the first writer that needs those bytes waits
    for the events (so the training thread never does).

    A snapshot that checksums pieces as it copies them (``kernels.copy_crc32c``: one pass over
    the bytes, not a copy and then a read-back) declares them in :attr:`checksummed` before its
    first :meth:`advance`, and puts each one's CRC-32C in :attr:`crcs` before ``ready`` passes
    the piece's end; the writer checksums only the other pieces.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.ready = 0
        self.error: str | None = None
        self.checksummed: frozenset[int] = frozenset()  # piece indices the snapshot's copy checksums
        self.crcs: dict[int, int] = {}  # piece index -> CRC-32C, from the snapshot's copy
        self._events: Sequence[Any] | None = None
        self._cond = threading.Condition()
        self.listeners: list[Callable[[int], None]] = []

    @property
    def complete(self) -> bool:
        return self.ready >= self.total and self._events is None

    def piece_crcs(self) -> dict[int, int]:
        """The CRC-32C of every declared piece (call once every byte is ready); RuntimeError if one is missing."""
        missing = sorted(self.checksummed - self.crcs.keys())
        if missing:  # a bug in the snapshot, never a user error
            raise RuntimeError(f"the snapshot declared pieces {missing[:5]} checksummed but gave no CRC for them")
        return {i: self.crcs[i] for i in self.checksummed}

    def advance(self, upto: int) -> None:
        with self._cond:
            if upto <= self.ready or self.error is not None:  # a failed snapshot never becomes complete
                return
            self.ready = min(upto, self.total)
            self._cond.notify_all()
        for fn in self.listeners:
            fn(self.ready)

    def complete_after(self, events: Sequence[Any]) -> None:
        """The rest of the image is ready once ``events`` (torch.cuda.Event) have completed."""
        with self._cond:
            self._events = list(events)
            self._cond.notify_all()

    def fail(self, message: str) -> None:
        with self._cond:
            if self.error is None and not self.complete:
                self.error = message
            self._cond.notify_all()

    def wait(self, need: int, timeout: float | None = None) -> int:
        """Block until at least ``need`` bytes are ready; returns how many are. Raises SnapshotAborted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.ready < need or self.error is not None:
                if self.error is not None:
                    raise SnapshotAborted(self.error)
                if self._events is not None:
                    events, self._events = self._events, None
                    self._cond.release()
                    try:
                        for ev in events:
                            ev.synchronize()
                    finally:
                        self._cond.acquire()
                    self.ready = self.total
                    self._cond.notify_all()
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"snapshot did not reach byte {need} within {timeout}s")
                self._cond.wait(left)
            return self.ready


# -- writing one image ---------------------------------------------------------------------------


def write_image(
    storage: Storage, rel_path: str, plan: PlanSpec, arena: Arena, progress: Progress
) -> list[tuple[str, Piece]]:
    """Stream the arena's file image to ``rel_path`` as the snapshot fills it; CRC-32C of every piece on the way.

    Like :func:`ucp.store.writer.write_rank_file`, but the bytes are already laid out as
    the file, so whole blocks go to disk straight from the (aligned) arena with no
    copy. Writes are issued in segments of ``queue_depth`` blocks. Pieces the snapshot
    checksummed while copying (``progress.checksummed``) are not read again here. On error
    the partial file is deleted.
    """
    cfg = storage.config
    block = cfg.block_size
    segment = block * max(1, cfg.queue_depth)
    size = plan.file_size
    with CrcChain() as crcs:
        writer = storage.open_writer(rel_path, size)
        try:
            pos, first = 0, 0  # pieces are in file order: those before ``first`` are done
            pieces = plan.pieces
            theirs: frozenset[int] | None = None  # the pieces the snapshot checksums (declared before any byte)
            while pos < size:
                ready = progress.wait(min(size, pos + block))  # at least a whole block (or the tail)
                if theirs is None:
                    theirs = progress.checksummed
                end = min(ready, pos + segment)
                if end < size:
                    end = pos + (end - pos) // block * block  # whole blocks: zero-copy, nothing staged
                view = arena.view(end - pos, pos)
                parts = []
                for i in range(first, len(pieces)):
                    p = pieces[i]
                    if p.offset >= end:
                        break
                    lo, hi = max(p.offset, pos), min(p.offset + p.length, end)
                    if lo < hi and i not in theirs:
                        parts.append((i, view[lo - pos : hi - pos]))
                    if p.offset + p.length <= end:
                        first = i + 1
                crcs.feed_many(parts)  # one hand-off per segment, however many pieces it holds
                writer.write(view, borrow=True)  # the arena stays unchanged until close(): no wait per segment
                pos = end
            written = writer.close()
            values = {**crcs.results(), **progress.piece_crcs()}
        except BaseException:
            writer.abort()
            raise
    if written != size:
        raise RuntimeError(f"{rel_path}: wrote {written} bytes, plan says {size}")
    return [
        (
            p.name,
            Piece.from_region(
                p.region(), file=plan.file, offset=p.offset, length=p.length, crc32c=values.get(i, 0), entry=p.entry
            ),
        )
        for i, p in enumerate(plan.pieces)
    ]


def write_streamed(
    storage: Storage, rel_path: str, plan: PlanSpec, arena: Arena, progress: Progress, *, buffers: int = 3
) -> list[tuple[str, Piece]]:
    """Write a streamed plan's file (``plan.streamed``): the header and the other pieces from the compact
    ``arena``, each StreamedShard's pieces read from its ``source`` files as they are written, through a
    :class:`~ucp.store.file_ranges.RangeReader` of ``buffers`` blocks (each block checked against its CRC-32C
    before a byte of it is written): never the streamed state whole in memory. Waits first until ``progress``
    is complete: the arena filled and the producer's files ready (SnapshotAborted if that failed)."""
    progress.wait(progress.total)
    largest = max((r.length for p in plan.pieces for r in p.source or ()), default=0)
    header = bytes(arena.view(plan.data_start, 0))
    pieces = tuple(  # what write_rank_file reads of a plan: names, regions, places in the file
        PlannedPiece(p.name, i, "", (), p.region(), p.offset, p.length, entry=p.entry)
        for i, p in enumerate(plan.pieces)
    )
    save_plan = SavePlan(0, 1, plan.file, header, pieces, plan.file_size, ())
    with RangeReader(storage.config, largest, buffers=buffers) as reader:
        views: list[PieceBytes] = []
        for p in plan.pieces:
            if p.source is not None:
                views.append(StreamedParts(partial(reader.parts, p.source)))
            else:
                assert p.arena is not None, f"piece {p.name!r} of a streamed plan has neither bytes nor a source"
                views.append(arena.view(p.length, p.arena))
        return write_rank_file(storage, rel_path, save_plan, views)
