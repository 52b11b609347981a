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
    """Populates ``memory`` (a writable mapping) in ``CHUNK`` steps on ``threads`` threads, in order.

    Holds an export of ``memory`` until every chunk is done (the mapping cannot be closed under it);
    :meth:`close` waits for the chunks in flight and drops it. Errors other than "not supported" are
    ignored: the reads fault in whatever is left, so population is only ever a speed-up.
    """

    def __init__(self, memory: mmap.mmap, nbytes: int, *, threads: int = 1, chunk: int = CHUNK) -> None:
        self.nbytes = min(nbytes, len(memory))
        self.chunk = max(mmap.PAGESIZE, chunk - chunk % mmap.PAGESIZE)
        self._futures: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._anchor: ctypes.Array[ctypes.c_char] | None = None
        self._lock = threading.Lock()
        madvise = _madvise()
        if madvise is None or self.nbytes <= 0:
            return
        self._anchor = (ctypes.c_char * self.nbytes).from_buffer(memory)
        base = ctypes.addressof(self._anchor)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucp-populate")
        self._futures = [
            self._pool.submit(self._populate, madvise, base + off, min(self.chunk, self.nbytes - off))
            for off in range(0, self.nbytes, self.chunk)
        ]

    @staticmethod
    def _populate(madvise: ctypes._CFuncPtr, addr: int, length: int) -> None:  # type: ignore[name-defined]
        global _unsupported
        if _unsupported:
            return
        if madvise(addr, length, MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
            _unsupported = True  # an older kernel: stop trying, the reads fault pages in themselves

    def wait(self, end: int) -> None:
        """Block until bytes ``[0, end)`` are populated (or population gave up on them)."""
        last = min(len(self._futures), -(-end // self.chunk))
        for fut in self._futures[:last]:
            fut.result()

    def close(self) -> None:
        """Wait for population to finish and release the mapping."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
            self._futures = []
            self._anchor = None
