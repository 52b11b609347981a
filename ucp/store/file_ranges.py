"""Bytes that another process can read for a save: runs of checked blocks of files on disk.

A :class:`ucp.StreamedShard` whose bytes also sit in plain files (training.offload: a copy of its swap files,
made for the save) says where in its ``source``: one :class:`FileRange` per consecutive run of its bytes, each
a slice of a *block* of a file whose CRC-32C is known (a sub-group's part of an optimizer record). A writer
process that cannot call the producer's ``parts()`` reads them itself with :class:`RangeReader`: each block
read whole through ``aio`` (O_DIRECT where aligned) into one of a few reused aligned buffers, checked against
its CRC before any byte of it is written, and kept in a small LRU (a shard's pieces are asked for in name
order, not block order). A mismatch, a short file or a failed read names the file and the block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Sequence

import crc32c
from pydantic import BaseModel, ConfigDict, Field

from aio.buffers import AlignedBuffer
from aio.config import AioConfig
from aio.engines import Engine, create_engine
from aio.errors import AioError
from aio.transfer import transfer
from ucp.errors import CorruptCheckpointError, StorageError


class FileRange(BaseModel):
    """Bytes ``[start, stop)`` of the block ``[offset, offset + length)`` of file ``path``, whose CRC-32C is
    ``crc32c``; ``what`` names the block in errors (``"sub-group 3 (...) exp_avg"``); ``alignment``: the
    block's offset and length are multiples of it, so it may be read with O_DIRECT (0: read it buffered)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    offset: int = Field(ge=0)
    length: int = Field(gt=0)
    crc32c: int = Field(ge=0, lt=1 << 32)
    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    what: str
    alignment: int = 0

    def model_post_init(self, _context: object) -> None:
        if not self.start <= self.stop <= self.length:
            raise ValueError(f"{self.what}: bytes [{self.start}, {self.stop}) outside its block of {self.length}")

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    @property
    def block(self) -> tuple[str, int, int]:
        return (self.path, self.offset, self.length)


class RangeReader:
    """Reads :class:`FileRange` runs for a writer: blocks read whole and checked, at most ``buffers`` of them
    held (reused aligned buffers of ``block_bytes``, the largest block to read, made on first use). Close it (or
    use it as a context manager) to free them and the engine."""

    def __init__(self, config: AioConfig, block_bytes: int, *, buffers: int = 3) -> None:
        self.config = config
        self.block_bytes = block_bytes
        self._engine: Engine | None = None
        self._buffers = max(1, buffers)
        self._own: list[AlignedBuffer] = []
        self._free: list[AlignedBuffer] = []
        self._cache: OrderedDict[tuple[str, int, int], AlignedBuffer] = OrderedDict()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def parts(self, ranges: Sequence[FileRange]) -> Iterator[memoryview]:
        """Each range's bytes, in order; a view is valid until the next one is asked for."""
        for r in ranges:
            if r.nbytes:
                yield self._block(r).view(r.stop, 0)[r.start :]

    def _block(self, r: FileRange) -> AlignedBuffer:
        buf = self._cache.get(r.block)
        if buf is not None:
            self._cache.move_to_end(r.block)
            return buf
        if self._free:
            buf = self._free.pop()
        elif len(self._own) < self._buffers:
            buf = AlignedBuffer(self.block_bytes)
            self._own.append(buf)
        else:
            buf = self._cache.popitem(last=False)[1]
        if r.length > buf.nbytes:
            self._free.append(buf)
            raise ValueError(f"{r.path} ({r.what}): a block of {r.length} bytes, the reader's are {buf.nbytes}")
        try:
            self._read(r, buf.view(r.length))
        except BaseException:
            self._free.append(buf)
            raise
        self._cache[r.block] = buf
        return buf

    def _read(self, r: FileRange, view: memoryview) -> None:
        """Fill ``view`` with ``r``'s block and check it is whole and its CRC-32C is the one it was given."""
        if self._engine is None:
            self._engine = create_engine(self.config)
        block = max(4096, self.config.block_size)
        direct = self.config.use_direct and r.alignment > 0 and (r.offset | r.length) % r.alignment == 0
        where = f"{r.path} ({r.what})"
        try:
            error, whole, size = transfer(self._engine, r.path, view, write=False, block=block, direct=direct, offset=r.offset)  # fmt: skip
        except AioError as exc:
            raise StorageError(f"cannot open {where} to save it: {exc}") from exc
        if error is not None:
            why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise StorageError(f"reading {where} to save it failed: {why}") from error
        if not whole:
            raise CorruptCheckpointError(
                f"{where} is truncated: {size} bytes, the save needs bytes [{r.offset}, {r.offset + r.length})"
            )
        crc = crc32c.crc32c(view)
        if crc != r.crc32c:
            raise CorruptCheckpointError(
                f"{where} is corrupt: bytes [{r.offset}, {r.offset + r.length}) have CRC-32C {crc:#010x}, "
                f"written as {r.crc32c:#010x} (changed before the save read it)"
            )

    def close(self) -> None:
        """Free the buffers and the engine; idempotent."""
        self._cache.clear()
        self._free.clear()
        self._own.clear()
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()


__all__ = ["FileRange", "RangeReader"]
