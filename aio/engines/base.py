"""The engine interface: submit reads and writes at file offsets, get futures back.

An engine moves bytes between a buffer and an open file at an offset. It does not
know about alignment rules; callers (``aio.stream``) hand it aligned requests for
O_DIRECT files. Each submitted request yields a ``concurrent.futures.Future``
whose result is the number of bytes moved: always the full length for writes,
and for reads fewer only when the file ends first. Short transfers are retried
inside the engine; failures raise ``AioError`` naming the file and offset.
"""

from __future__ import annotations

import abc
import errno
import os
from concurrent.futures import Future

from ..errors import AioError
from ..files import OpenFile

# One read()/write() syscall moves at most 2 GiB - 4 KiB on Linux.
MAX_SYSCALL_BYTES = 0x7FFFF000


class Engine(abc.ABC):
    """An async file I/O engine."""

    name: str = "?"

    @abc.abstractmethod
    def submit_read(self, f: OpenFile, offset: int, buf: memoryview) -> "Future[int]":
        """Read ``len(buf)`` bytes from ``f`` at ``offset`` into ``buf``."""

    @abc.abstractmethod
    def submit_write(self, f: OpenFile, offset: int, buf: memoryview) -> "Future[int]":
        """Write all of ``buf`` to ``f`` at ``offset``."""

    def close(self) -> None:
        """Wait for in-flight requests and release the engine's resources."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pread_full(f: OpenFile, offset: int, buf: memoryview) -> int:
    """Blocking read of all of ``buf`` (less only at end of file), retrying short reads."""
    done, total = 0, buf.nbytes
    while done < total:
        chunk = buf[done : done + min(total - done, MAX_SYSCALL_BYTES)]
        try:
            n = os.preadv(f.fd, [chunk], offset + done)
        except OSError as exc:
            raise AioError(exc.errno or errno.EIO, f.path, offset + done, "read") from exc
        if n == 0:
            break
        done += n
    return done


def pwrite_full(f: OpenFile, offset: int, buf: memoryview) -> int:
    """Blocking write of all of ``buf``, retrying short writes."""
    done, total = 0, buf.nbytes
    while done < total:
        chunk = buf[done : done + min(total - done, MAX_SYSCALL_BYTES)]
        try:
            n = os.pwritev(f.fd, [chunk], offset + done)
        except OSError as exc:
            raise AioError(exc.errno or errno.EIO, f.path, offset + done, "write") from exc
        if n == 0:
            raise AioError(errno.EIO, f.path, offset + done, "write made no progress")
        done += n
    return done
