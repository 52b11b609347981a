"""The portable engine: positional reads and writes on a pool of threads.

``os.preadv``/``os.pwritev`` release the GIL, so N threads keep N requests in
flight at the device. Works on any OS and file system Python supports.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from ..files import OpenFile
from .base import Engine, pread_full, pwrite_full


class ThreadEngine(Engine):
    name = "threads"

    def __init__(self, thread_count: int = 4) -> None:
        self.thread_count = thread_count
        self._pool = ThreadPoolExecutor(max_workers=thread_count, thread_name_prefix="ucp-io")

    def submit_read(self, f: OpenFile, offset: int, buf: memoryview) -> "Future[int]":
        return self._pool.submit(pread_full, f, offset, buf)

    def submit_write(self, f: OpenFile, offset: int, buf: memoryview) -> "Future[int]":
        return self._pool.submit(pwrite_full, f, offset, buf)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
