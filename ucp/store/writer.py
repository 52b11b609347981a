"""Step (c) of a save: stream one rank's data file from byte views, computing CRC-32C on the way out.

The header goes first, then each piece's bytes in plan order, in chunks. Each
chunk is handed to the file writer (which copies it into an aligned staging
block and keeps ``queue_depth`` requests in flight) and, in parallel, to a
checksum thread (``crc32c`` releases the GIL and uses the CPU's CRC
instructions), so checksumming costs no disk time and nothing is read back.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import crc32c as _crc32c

from ucp.format.manifest import Piece
from ucp.saving.plan import SavePlan
from ucp.store.storage import Storage

CHUNK = 8 << 20  # checksum/submit granularity; one aio block by default
INLINE_CRC = 256 << 10  # pieces up to this size are checksummed on the calling thread


class CrcChain:
    """Running CRC-32C of several byte streams, computed in order on one background thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-crc")
        self._values: dict[int, int] = {}
        self._last: Future | None = None

    def feed(self, key: int, data: memoryview) -> None:
        """Extend stream ``key`` with ``data`` (which must stay unchanged until :meth:`results`)."""
        self._last = self._pool.submit(self._update, key, data)

    def feed_many(self, parts: Sequence[tuple[int, memoryview]]) -> None:
        """Extend several streams in one hand-off (many small pieces cost one task, not one each)."""
        if parts:
            self._last = self._pool.submit(self._update_many, parts)

    def _update(self, key: int, data: memoryview) -> None:
        self._values[key] = _crc32c.crc32c(data, self._values.get(key, 0))

    def _update_many(self, parts: Sequence[tuple[int, memoryview]]) -> None:
        for key, data in parts:
            self._update(key, data)

    def results(self) -> dict[int, int]:
        """Wait for every chunk fed so far; the CRC of each stream (0 for empty ones)."""
        if self._last is not None:
            self._last.result()  # FIFO on one worker: everything before it is done too
        return dict(self._values)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "CrcChain":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamedParts:
    """A piece's bytes as consecutive parts whose memory their producer reuses (a ``ucp.StreamedShard``'s):
    :func:`write_rank_file` writes and checksums each part before it asks for the next, instead of
    handing parts to the checksum thread and the device while it moves on."""

    def __init__(self, parts: Callable[[], Iterable[memoryview]]) -> None:
        self._parts = parts

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self._parts())


PieceBytes = memoryview | Iterable[memoryview]


def write_rank_file(
    storage: Storage,
    rel_path: str,
    plan: SavePlan,
    views: Sequence[PieceBytes],
    *,
    chunk: int = CHUNK,
    known_crcs: Mapping[int, int] | None = None,
) -> list[tuple[str, Piece]]:
    """Write ``plan``'s file at ``rel_path`` from ``views`` (one per planned piece).

    A piece's bytes are one memoryview, or an iterable of consecutive memoryviews (a piece larger
    than the memory its writer may hold, produced part by part: ``ucp reshape``). Returns
    ``(tensor name, manifest piece)`` for every piece, the file name in each piece being the
    plan's (relative to the checkpoint directory). On any error the partial file is deleted and
    the error propagates. The views must not change until this returns.

    ``known_crcs``: piece index -> the CRC-32C of its bytes, known already (a reshape copying a stored
    piece whole, whose CRC the read checks): those pieces are written without being checksummed again.
    """
    if plan.file is None:
        return []
    if len(views) != len(plan.pieces):
        raise ValueError(f"{len(views)} byte views for {len(plan.pieces)} planned pieces")
    inline: dict[int, int] = dict(known_crcs or {})  # and small pieces: checksummed here, a hand-off costs more
    with CrcChain() as crcs:
        writer = storage.open_writer(rel_path, plan.file_size)
        try:
            writer.write(plan.header)
            pos = plan.data_start
            for i, (view, piece) in enumerate(zip(views, plan.pieces)):
                if piece.offset > pos:  # a padding entry that puts the piece in phase with its memory
                    writer.write(bytes(piece.offset - pos))
                if isinstance(view, memoryview) and view.nbytes <= INLINE_CRC:
                    if i not in inline:
                        inline[i] = _crc32c.crc32c(view)
                    writer.write(view)
                    pos = piece.offset + view.nbytes
                    continue
                pos = piece.offset
                known = i in inline
                if isinstance(view, StreamedParts):  # each part written and checksummed before the next is made
                    crc = 0
                    for part in view:
                        crc = crc if known else _crc32c.crc32c(part, crc)
                        writer.write(part)  # not borrowed: returns once the memory may be reused
                        pos += part.nbytes
                    inline.setdefault(i, crc)
                else:
                    for part in (view,) if isinstance(view, memoryview) else view:
                        for start in range(0, part.nbytes, chunk):
                            block = part[start : start + chunk]
                            if not known:
                                crcs.feed(i, block)
                            writer.write(block, borrow=True)  # the views stay unchanged until we return
                        pos += part.nbytes
                if pos != piece.offset + piece.length:
                    raise RuntimeError(
                        f"{rel_path}: piece {piece.name!r} got {pos - piece.offset} bytes, the plan says {piece.length}"
                    )
            size = writer.close()
            values = {**crcs.results(), **inline}
        except BaseException:
            writer.abort()
            raise
    if size != plan.file_size:  # a bug, not a user error: the plan and the bytes disagree
        raise RuntimeError(f"{rel_path}: wrote {size} bytes, plan says {plan.file_size}")
    return [
        (
            p.name,
            Piece.from_region(
                p.region, file=plan.file, offset=p.offset, length=p.length, crc32c=values.get(i, 0), entry=p.entry
            ),
        )
        for i, p in enumerate(plan.pieces)
    ]
