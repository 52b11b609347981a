"""Fault fresh anonymous memory in ahead of the reads that fill it, on other threads.

Why: reading into never-touched memory halves throughput here (the kernel zero-fills and maps each
page as an O_DIRECT request is submitted, ~0.6 s per GB on our VMs, serially in the submitting
thread), and ``MAP_POPULATE`` does the same work up front before any I/O starts. A
:class:`Populator` instead faults the mapping in chunk by chunk, in order, with
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+; it releases the GIL), while the reads of earlier
chunks are in flight; a reader calls :meth:`Populator.wait` before submitting a request, so its
pages are mapped already and the submission does no faulting.

Where the kernel lacks MADV_POPULATE_WRITE the populator does nothing (``wait`` returns at once) and
the reads fault pages in themselves, as before.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
from concurrent.futures import Future, ThreadPoolExecutor

MADV_POPULATE_WRITE = 23  # linux/mman.h; not exported by Python's mmap module
CHUNK = 16 << 20  # bytes populated per madvise call: small enough for reads to start early

_libc: ctypes.CDLL | None = None
_unsupported = False


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _libc
    if _unsupported:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


class Populator:
    """Populates memory in ``CHUNK`` steps on ``threads`` threads, in order: ``[0, nbytes)`` of ``memory``
    (a writable mapping), or with :meth:`of_ranges` several ranges of several mappings.

    Holds an export of each mapping until every chunk is done (a mapping cannot be closed under it);
    :meth:`close` waits for the chunks in flight and drops them. Errors other than "not supported" are
    ignored: the reads fault in whatever is left, so population is only ever a speed-up.
    """

    def __init__(self, memory: mmap.mmap | None, nbytes: int = 0, *, threads: int = 1, chunk: int = CHUNK) -> None:
        self.chunk = max(mmap.PAGESIZE, chunk - chunk % mmap.PAGESIZE)
        self._threads = threads
        self._futures: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._anchors: list[ctypes.Array[ctypes.c_char]] = []
        self._lock = threading.Lock()
        if memory is not None:
            self._start([(memory, 0, min(nbytes, len(memory)))])

    @classmethod
    def of_ranges(
        cls, ranges: list[tuple[mmap.mmap, int, int]], *, threads: int = 1, chunk: int = CHUNK
    ) -> "Populator":
        """Populate ``(mapping, start, length)`` ranges, in the order given (the order they will be read in)."""
        self = cls(None, threads=threads, chunk=chunk)
        self._start(ranges)
        return self

    def _start(self, ranges: list[tuple[mmap.mmap, int, int]]) -> None:
        madvise = _madvise()
        if madvise is None:
            return
        jobs: list[tuple[int, int]] = []
        anchors: dict[int, tuple[ctypes.Array[ctypes.c_char], int]] = {}
        for memory, start, length in ranges:
            start, end = max(0, start - start % mmap.PAGESIZE), min(len(memory), start + length)
            if end <= start:
                continue
            if id(memory) not in anchors:
                anchor = (ctypes.c_char * len(memory)).from_buffer(memory)
                anchors[id(memory)] = (anchor, ctypes.addressof(anchor))
            base = anchors[id(memory)][1]
            jobs.extend((base + off, min(self.chunk, end - off)) for off in range(start, end, self.chunk))
        if not jobs:
            return
        self._anchors = [a for a, _ in anchors.values()]
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="ucp-populate")
        self._futures = [self._pool.submit(self._populate, madvise, addr, n) for addr, n in jobs]

    @staticmethod
    def _populate(madvise: ctypes._CFuncPtr, addr: int, length: int) -> None:  # type: ignore[name-defined]
        global _unsupported
        if _unsupported:
            return
        if madvise(addr, length, MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
            _unsupported = True  # an older kernel: stop trying, the reads fault pages in themselves

    def wait(self, end: int) -> None:
        """Block until bytes ``[0, end)`` are populated (or population gave up on them); one mapping only."""
        last = min(len(self._futures), -(-end // self.chunk))
        for fut in self._futures[:last]:
            fut.result()

    def close(self, *, finish: bool = False) -> None:
        """Stop populating (``finish``: populate every chunk first) and release the mappings.

        Chunks not yet started are dropped: once the reads are done, they have faulted in their pages."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=not finish)
                self._pool = None
            self._futures = []
            self._anchors = []
