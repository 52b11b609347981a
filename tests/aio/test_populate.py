"""aio.populate.Populator: faulting memory in ahead of reads never changes what the memory holds."""

from __future__ import annotations

import mmap

import pytest

import aio.populate as populate
from aio.populate import Populator


def _rss_pages(m: mmap.mmap) -> int:
    """Resident pages of ``m`` (mincore(2))."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    anchor = (ctypes.c_char * len(m)).from_buffer(m)
    vec = (ctypes.c_ubyte * (len(m) // mmap.PAGESIZE))()
    try:
        assert libc.mincore(ctypes.addressof(anchor), len(m), vec) == 0, ctypes.get_errno()
    finally:
        del anchor
    return sum(v & 1 for v in vec)


def test_populates_a_whole_mapping_keeping_its_bytes() -> None:
    m = mmap.mmap(-1, 6 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m[5000:5004] = b"ucp!"  # written before: populating must not zero it again
    p = Populator(m, len(m), chunk=1 << 20)
    p.wait(len(m))
    p.close()
    assert m[5000:5004] == b"ucp!" and m[:4] == b"\0\0\0\0"
    if not populate._unsupported:
        assert _rss_pages(m) == len(m) // mmap.PAGESIZE
    m.close()  # no export left behind: the mapping can be closed


def test_of_ranges_populates_only_the_ranges_given() -> None:
    a = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    b = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    p = Populator.of_ranges([(a, 2 << 20, 1 << 20), (b, 0, 4 << 20), (a, 0, 0)], chunk=1 << 20)
    p.close(finish=True)
    if populate._unsupported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert _rss_pages(a) == (1 << 20) // mmap.PAGESIZE and _rss_pages(b) == (4 << 20) // mmap.PAGESIZE
    a.close()
    b.close()


def test_an_unsupported_kernel_makes_it_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(populate, "_unsupported", True)
    m = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    p = Populator(m, len(m))
    p.wait(len(m))  # returns at once
    p.close()
    assert _rss_pages(m) == 0
    m.close()
