"""The portable engine: positional reads and writes on a pool of threads.

``os.preadv``/``os.pwritev`` release the GIL, so N threads keep N requests in
flight at the device. Works on any OS and file system Python supports.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from aio.files import OpenFile

from .base import IOV_MAX, Engine, pread_full, pwrite_full, signals_held


class ThreadEngine(Engine):
    name = "threads"
    max_segments = IOV_MAX

    def __init__(self, thread_count: int = 4) -> None:
        self.thread_count = thread_count
        self._pool = ThreadPoolExecutor(max_workers=thread_count, thread_name_prefix="ucp-io")
        self._closed = False

    def submit_read(
        self, f: OpenFile, offset: int, buf: memoryview, future: "Future[int] | None" = None
    ) -> "Future[int]":
        self._check_open("reading", f, offset)
        return self._start(pread_full, f, offset, buf, future or Future())

    def submit_readv(
        self, f: OpenFile, offset: int, buffers: Sequence[memoryview], future: "Future[int] | None" = None
    ) -> "Future[int]":
        self._check_open("reading", f, offset)
        return self._start(pread_full, f, offset, list(buffers), future or Future())

    def submit_write(
        self, f: OpenFile, offset: int, buf: memoryview, future: "Future[int] | None" = None
    ) -> "Future[int]":
        self._check_open("writing", f, offset)
        return self._start(pwrite_full, f, offset, buf, future or Future())

    def _start(
        self, move: Callable[[OpenFile, int, Any], int], f: OpenFile, offset: int, buf: Any, future: "Future[int]"
    ) -> "Future[int]":
        """Queue ``move`` on the pool to complete ``future``, set running first (see :mod:`aio.engines.base`)."""

        def run() -> None:
            try:
                future.set_result(move(f, offset, buf))
            except BaseException as exc:  # noqa: BLE001 - the waiter gets it
                future.set_exception(exc)

        with signals_held():  # running and queued, or neither
            future.set_running_or_notify_cancel()
            try:
                self._pool.submit(run)
            except BaseException as exc:  # the pool shut down meanwhile
                future.set_exception(exc)
                raise
        return future

    def _check_open(self, doing: str, f: OpenFile, offset: int) -> None:
        """The same refusal as the libaio engine's (the executor's own RuntimeError names no file)."""
        if self._closed:
            raise ValueError(f"I/O on a closed ThreadEngine ({doing} {f.path!r} at offset {offset})")

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
