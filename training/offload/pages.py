"""Giving the pages of a spent buffer back to the system while keeping its contents defined (zeros).

Why: an armed offloaded step (training.zero's ``prepare_step``) is done with a sub-group's fp32 gradient
as soon as the tier has updated it; zeroing the slice in place would keep all of the gradient partition
resident for the whole step. ``madvise(MADV_DONTNEED)`` on private anonymous memory drops the pages and
makes them read back as zeros, which is the state the next backward expects to add into.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

MADV_DONTNEED = 4  # linux/mman.h

_libc: ctypes.CDLL | None = None


def _madvise(addr: int, length: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return bool(_libc.madvise(addr, length, MADV_DONTNEED) == 0)


def release_zeroed(t: torch.Tensor) -> int:
    """Set the contiguous CPU tensor ``t`` to zeros, giving back to the system the whole pages it spans
    (their next touch maps fresh zeroed pages); the partial pages at either end are zeroed in place.
    Returns the bytes given back (0 where the tensor is not on the CPU, too small, or madvise refuses)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        t.zero_()
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    page = mmap.PAGESIZE
    lo = -(-start // page) * page
    hi = end // page * page
    if hi <= lo or (lo - start) % t.element_size() or (end - hi) % t.element_size():
        t.zero_()
        return 0
    head = (lo - start) // t.element_size()
    tail = (end - hi) // t.element_size()
    if not _madvise(lo, hi - lo):
        t.zero_()
        return 0
    t[:head].zero_()
    if tail:
        t[t.numel() - tail :].zero_()
    return hi - lo
