"""Page-aligned, pre-faulted, reusable host buffers.

O_DIRECT needs aligned memory, and reading into never-touched pages costs a
page fault per 4 KiB in the middle of the transfer (it halved read throughput on
our test machine). So buffers are anonymous ``mmap`` regions (page aligned by
construction), populated up front with ``MAP_POPULATE``, and kept in a pool for
reuse. When CUDA is present they are also registered as pinned memory so that
host-to-device copies from them are asynchronous.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy and torch are imported where an array or tensor is asked for (start-up time)
    import numpy as np
    import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def round_down(n: int, multiple: int) -> int:
    return n // multiple * multiple


def address_of(buf: memoryview) -> int:
    """Address of the first byte of a writable or read-only buffer."""
    if buf.nbytes == 0:
        return 0
    if not buf.readonly:  # without numpy, whose import costs a one-shot command ~0.1 s of start-up
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    import numpy as np

    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


class AlignedBuffer:
    """One page-aligned host buffer, viewable without copies as memoryview/numpy/torch.

    ``huge``: ask for transparent huge pages (``madvise(MADV_HUGEPAGE)`` before the pages are populated), for a
    long-lived buffer that O_DIRECT moves every step (the offload tiers' slots): the kernel then pins 2 MiB pages
    for each request instead of 512 small ones, and Adam and CRC-32C walk fewer TLB entries. Where the kernel
    refuses (THP off, no MADV_POPULATE_WRITE) it is an ordinary buffer."""

    def __init__(self, nbytes: int, *, pin: bool | None = None, huge: bool = False) -> None:
        if nbytes < 0:
            raise ValueError(f"buffer size must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        self._capacity = max(round_up(nbytes, PAGE), PAGE)
        self._mmap = _huge(self._capacity) if huge and self._capacity >= HUGE_PAGE else None
        if self._mmap is None:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(-1, self._capacity, flags=flags)
        self._view = memoryview(self._mmap)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self.pinned = False
        if pin is None:
            pin = _cuda_available()
        if pin:
            self.pinned = _cuda_host_register(self.address, self._capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    def view(self, nbytes: int | None = None, offset: int = 0) -> memoryview:
        """A memoryview of ``nbytes`` bytes from ``offset`` (whole buffer by default)."""
        end = self.nbytes if nbytes is None else offset + nbytes
        if offset < 0 or end > self._capacity:
            raise ValueError(f"view [{offset}, {end}) outside buffer of {self._capacity} bytes")
        return self._view[offset:end]

    def numpy(self, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        import numpy as np

        return np.frombuffer(self.view(nbytes, offset), dtype=np.uint8)

    def tensor(self, nbytes: int | None = None, offset: int = 0) -> "torch.Tensor":
        import torch

        view = self.view(nbytes, offset)
        if view.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(view, dtype=torch.uint8)

    def resize(self, nbytes: int) -> None:
        """Use the first ``nbytes`` bytes (must fit the capacity)."""
        if nbytes > self._capacity:
            raise ValueError(f"{nbytes} bytes do not fit a buffer of {self._capacity}")
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"AlignedBuffer(nbytes={self.nbytes}, capacity={self._capacity}, pinned={self.pinned})"

    def __del__(self) -> None:
        # A pinned range stays registered with the CUDA driver after the memory is unmapped: the
        # next buffer mapped at that address could then not be pinned (and would silently stay
        # pageable). Unregister before the mapping goes.
        if getattr(self, "pinned", False):
            _cuda_host_unregister(self.address)
            self.pinned = False


class BufferPool:
    """A bounded pool of reusable aligned buffers of one size.

    ``acquire`` blocks when ``max_buffers`` are out, which is how callers bound
    their memory; ``release`` hands a buffer back for reuse.
    """

    def __init__(self, buffer_size: int, max_buffers: int, *, pin: bool | None = None) -> None:
        if max_buffers < 1:
            raise ValueError("a buffer pool needs at least one buffer")
        self.buffer_size = round_up(buffer_size, PAGE)
        self.max_buffers = max_buffers
        self._pin = pin
        self._free: list[AlignedBuffer] = []
        self._created = 0
        self._cond = threading.Condition()

    def acquire(self, timeout: float | None = None) -> AlignedBuffer:
        with self._cond:
            while not self._free and self._created >= self.max_buffers:
                if not self._cond.wait(timeout):
                    raise TimeoutError(f"no free buffer of {self.buffer_size} bytes within {timeout}s")
            if self._free:
                buf = self._free.pop()
                buf.resize(self.buffer_size)
                return buf
            self._created += 1
        return AlignedBuffer(self.buffer_size, pin=self._pin)

    def release(self, buf: AlignedBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def reserve(self, n: int) -> None:
        """Raise the bound by ``n`` buffers (lower it with a negative ``n``) for a holder that keeps one."""
        with self._cond:
            self.max_buffers += n
            self._cond.notify_all()

    @property
    def created(self) -> int:
        return self._created


def _cuda_available() -> bool:
    """Whether pinning is worth it: CUDA is there. A process that has not imported torch has no GPU
    tensors to copy to or from, so it is not asked (and torch's ~1.5 s import is not paid for it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken CUDA
        return False


def _cuda_host_unregister(address: int) -> None:
    """Undo :func:`_cuda_host_register` (best effort: at interpreter exit CUDA may be gone)."""
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # pragma: no cover - GPU only  # noqa: BLE001
        pass


def _cuda_host_register(address: int, nbytes: int) -> bool:
    """Pin an existing host range for the CUDA driver (cudaHostRegister)."""
    try:
        import torch

        rc = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        ok = int(rc) == 0
        if not ok:
            log.info("cudaHostRegister failed (%s); the buffer stays pageable", rc)
        return ok
    except Exception as exc:  # pragma: no cover - GPU only
        log.info("pinning unavailable: %s", exc)
        return False


def _huge(capacity: int) -> mmap.mmap | None:
    """An anonymous mapping of ``capacity`` bytes advised for huge pages, then populated; None where the kernel
    cannot (the caller maps an ordinary one)."""
    from .populate import MADV_POPULATE_WRITE

    hint = getattr(mmap, "MADV_HUGEPAGE", None)
    if hint is None:
        return None
    m = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(hint)
        m.madvise(MADV_POPULATE_WRITE)  # the pages now, not a fault per page in the middle of a transfer
    except OSError:
        m.close()
        return None
    return m
