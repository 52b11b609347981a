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
from typing import Any, Iterator, Sequence

from aio.errors import AioError
from aio.files import OpenFile

# One read()/write() syscall moves at most 2 GiB - 4 KiB on Linux.
MAX_SYSCALL_BYTES = 0x7FFFF000
try:  # buffers one preadv / IOCB_CMD_PREADV takes
    IOV_MAX = max(1, os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError):  # pragma: no cover - not a POSIX system
    IOV_MAX = 16


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)
HELD_WAIT = 0.05  # seconds one held wait (for a slot, a staging block) lasts before a noted Ctrl-C is raised


class _Recorder:
    """The handler of the held signals: notes each while its block runs. Once the block is over it
    hands every signal straight to the real handler, so one left installed (a signal that raced the
    restore of the handlers) still does what the real handler does."""

    def __init__(self, real: dict[int, Any]) -> None:
        self.real = real
        self.noted: list[int] = []
        self.holding = True

    def __call__(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.noted.append(signum)
        else:
            _hand_on(self.real[signum], signum, frame)


_holder: _Recorder | None = None  # the outermost block holding the signals in the main thread


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Defer SIGINT/SIGTERM for the duration: the KeyboardInterrupt (or whatever their handlers do)
    comes once the block is done, never half way through it.

    Python runs signal handlers, and so raises KeyboardInterrupt, only in the main thread, but the
    kernel may deliver a process-directed signal to any thread, so blocking it in the main thread
    is not enough: the handlers themselves are swapped for a :class:`_Recorder`, and the noted
    signals are handed to the real handlers on the way out (every one, the first exception raised
    after). Other threads need nothing; a nested block leaves all of it to the outermost one.
    """
    global _holder
    if threading.current_thread() is not threading.main_thread() or (_holder is not None and _holder.holding):
        yield
        return
    real: dict[int, Any] = {}
    for s in HELD_SIGNALS:
        handler = signal.getsignal(s)
        if isinstance(handler, _Recorder):  # left installed by an earlier block's raced restore
            handler = handler.real.get(s)
        if handler is not None:  # None: a handler not set from Python, left alone
            real[s] = handler
    recorder = _Recorder(real)
    try:
        _holder = recorder
        _install(dict.fromkeys(real, recorder))
        yield
    finally:
        recorder.holding = False  # from here on every signal meets its real handler, whichever is installed
        if _holder is recorder:
            _holder = None
        try:
            _install(real)
        finally:
            _replay(recorder.noted, real)


def _install(handlers: dict[int, Any]) -> None:
    """Set every handler in ``handlers``, even when a signal's handler raises on the way.

    ``signal.signal`` first runs the handlers of signals already pending; one that raises (a
    KeyboardInterrupt) must not leave the other swaps undone, so each is retried and the first
    exception raised once all are set.
    """
    error: BaseException | None = None
    left = list(handlers.items())
    while left:
        try:
            while left:
                signal.signal(*left[0])
                left.pop(0)
        except BaseException as exc:  # noqa: BLE001 - a pending signal's handler; raised below
            error = error or exc
    if error is not None:
        raise error


def _hand_on(handler: Any, signum: int, frame: Any) -> None:
    """Do what ``handler`` (a Python handler, SIG_DFL or SIG_IGN) does with signal ``signum``."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _replay(noted: list[int], handlers: dict[int, Any]) -> None:
    """Hand each noted signal (once) to its real handler; the first exception is raised after all ran."""
    error: BaseException | None = None
    for s in dict.fromkeys(noted):
        try:
            _hand_on(handlers[s], s, None)
        except BaseException as exc:  # noqa: BLE001 - raised once every noted signal was handed on
            error = error or exc
    if error is not None:
        raise error


def _after_fork_in_child() -> None:
    """A child forked (by any thread) while the main thread held the signals gets the real handlers."""
    global _holder
    recorder, _holder = _holder, None
    if recorder is not None:
        recorder.holding = False
        try:
            _install(recorder.real)
        except (ValueError, OSError):  # not this interpreter's main thread: the recorder forwards anyway
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)


class Engine(abc.ABC):
    """An async file I/O engine."""

    name: str = "?"
    max_segments: int = 1  # buffers one read may scatter into (``submit_readv``); 1: one buffer per request

    @abc.abstractmethod
    def submit_read(
        self, f: OpenFile, offset: int, buf: memoryview, future: "Future[int] | None" = None
    ) -> "Future[int]":
        """Read ``len(buf)`` bytes from ``f`` at ``offset`` into ``buf``; completes ``future`` if given."""

    def submit_readv(
        self, f: OpenFile, offset: int, buffers: Sequence[memoryview], future: "Future[int] | None" = None
    ) -> "Future[int]":
        """Read consecutive bytes of ``f`` from ``offset`` into ``buffers`` in order, as one request (at
        most ``max_segments`` of them); the result counts the bytes read in all."""
        raise NotImplementedError(f"the {self.name} engine reads into one buffer per request")

    @abc.abstractmethod
    def submit_write(
        self, f: OpenFile, offset: int, buf: memoryview, future: "Future[int] | None" = None
    ) -> "Future[int]":
        """Write all of ``buf`` to ``f`` at ``offset``; completes ``future`` if given."""

    def close(self) -> None:  # noqa: B027 - a no-op default, not abstract: an engine holding nothing overrides nothing
        """Wait for in-flight requests and release the engine's resources."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rest_of(buffers: Sequence[memoryview], done: int) -> list[memoryview]:
    """What is left of ``buffers`` (in order) after their first ``done`` bytes were moved."""
    out = []
    for b in buffers:
        if done >= b.nbytes:
            done -= b.nbytes
            continue
        out.append(b[done:] if done else b)
        done = 0
    return out


def pread_full(f: OpenFile, offset: int, buf: memoryview | Sequence[memoryview]) -> int:
    """Blocking read of all of ``buf`` (one buffer, or several filled in order: ``preadv``), less only at
    end of file, retrying short reads."""
    buffers = [buf] if isinstance(buf, memoryview) else list(buf)
    done, total = 0, sum(b.nbytes for b in buffers)
    while done < total:
        chunk = _at_most(rest_of(buffers, done), MAX_SYSCALL_BYTES)
        try:
            n = os.preadv(f.fd, chunk, offset + done)
        except OSError as exc:
            raise AioError(exc.errno or errno.EIO, f.path, offset + done, "read") from exc
        if n == 0:
            break
        done += n
    return done


def _at_most(buffers: list[memoryview], limit: int) -> list[memoryview]:
    """The leading buffers holding at most ``limit`` bytes (one syscall's worth)."""
    out, left = [], limit
    for b in buffers:
        if left <= 0:
            break
        out.append(b[:left] if b.nbytes > left else b)
        left -= b.nbytes
    return out


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
