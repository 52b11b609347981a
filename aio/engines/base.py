"""The engine interface: submit reads and writes at file offsets, get futures back.

An engine moves bytes between a buffer and an open file at an offset. It does not
know about alignment rules; callers (``aio.stream``) hand it aligned requests for
O_DIRECT files. Each submitted request yields a ``concurrent.futures.Future``
whose result is the number of bytes moved: always the full length for writes,
and for reads fewer only when the file ends first. Short transfers are retried
inside the engine; failures raise ``AioError`` naming the file and offset.

A caller may pass the future to complete (``future=``), with its callbacks already attached. The
engine sets it running (``Future.running()``) once it has taken the request: from then on only the
engine completes it, and the buffer must stay valid until it does. A submit that raises before
that leaves the future pending, so a caller interrupted (Ctrl-C) anywhere in a submit can tell
whether its buffer is still in use: pending means it never will be.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import os
import signal
import threading
from concurrent.futures import Future
from typing import Iterator

from ..errors import AioError
from ..files import OpenFile

# One read()/write() syscall moves at most 2 GiB - 4 KiB on Linux.
MAX_SYSCALL_BYTES = 0x7FFFF000


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_held_depth = 0  # signals_held() blocks open in the main thread (only the outermost swaps the handlers)
HELD_WAIT = 0.05  # seconds one held wait (for a slot, a staging block) lasts before a noted Ctrl-C is raised


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Defer SIGINT/SIGTERM for the duration: the KeyboardInterrupt (or whatever their handlers do)
    comes once the block is done, never half way through it.

    Python runs signal handlers, and so raises KeyboardInterrupt, only in the main thread, but the
    kernel may deliver a process-directed signal to any thread, so blocking it in the main thread
    is not enough: the handlers themselves are swapped for one that notes the signal, and the noted
    signals are handed to the real handlers on the way out. Other threads need nothing.
    """
    global _held_depth
    if threading.current_thread() is not threading.main_thread() or _held_depth:  # nested: the outer one holds
        yield
        return
    noted: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: noted.append(signum))
           for s in HELD_SIGNALS if signal.getsignal(s) is not None}  # None: a handler not set from Python
    _held_depth += 1
    try:
        yield
    finally:
        _held_depth -= 1
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(noted):
            handler = old[s]
            if callable(handler):
                handler(s, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(s)


class Engine(abc.ABC):
    """An async file I/O engine."""

    name: str = "?"

    @abc.abstractmethod
    def submit_read(self, f: OpenFile, offset: int, buf: memoryview,
                    future: "Future[int] | None" = None) -> "Future[int]":
        """Read ``len(buf)`` bytes from ``f`` at ``offset`` into ``buf``; completes ``future`` if given."""

    @abc.abstractmethod
    def submit_write(self, f: OpenFile, offset: int, buf: memoryview,
                     future: "Future[int] | None" = None) -> "Future[int]":
        """Write all of ``buf`` to ``f`` at ``offset``; completes ``future`` if given."""

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
