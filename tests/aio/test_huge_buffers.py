"""``AlignedBuffer(huge=True)``: a buffer the offload tiers move with O_DIRECT every step is marked for
transparent huge pages (the kernel backs it with them where it finds free 2 MiB pages), populated up front like
any other buffer (no fault in the middle of a transfer), and works as an ordinary buffer (and is one where THP
is off or the buffer is under 2 MiB)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from aio.buffers import HUGE_PAGE, AlignedBuffer
from aio.config import AioConfig
from aio.engines import create_engine
from aio.files import open_file

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vma(address: int) -> dict[str, int]:
    """The smaps fields (kB) of the mapping that holds ``address`` (the kernel may have merged the buffer's
    mapping with a neighbour of the same flags)."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and len(line.split()) >= 2 and line.split()[1].isdigit():
            fields[head.rstrip(":")] = int(line.split()[1])  # kB, or a flag such as THPeligible
    return fields


def resident_pages(buf: AlignedBuffer) -> int:
    """Pages of ``buf`` in memory (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * (buf.capacity // mmap.PAGESIZE))()
    assert libc.mincore(buf.address, buf.capacity, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def thp_on() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def test_a_huge_buffer_is_populated_zeroed_and_on_huge_pages_where_the_kernel_allows(tmp_path: Path) -> None:
    buf = AlignedBuffer(4 * HUGE_PAGE + 4096, huge=True)
    assert buf.nbytes == 4 * HUGE_PAGE + 4096 and buf.address % 4096 == 0
    assert resident_pages(buf) == buf.capacity // mmap.PAGESIZE  # populated: no fault left for a transfer to take
    if thp_on():  # asked for huge pages (madvise); whether the kernel found free 2 MiB pages depends on fragmentation
        assert vma(buf.address).get("THPeligible", 1) == 1
    view = buf.view()
    assert not any(view[:: 4096 * 7])  # zero-filled
    data = os.urandom(buf.nbytes)
    view[:] = data
    path = tmp_path / "f.bin"
    engine = create_engine(AioConfig(queue_depth=4, block_size=1 << 20))
    try:  # through O_DIRECT both ways, as the offload tiers move it
        with open_file(path, "w", direct=True) as f:
            assert engine.submit_write(f, 0, buf.view()).result() == buf.nbytes
        back = AlignedBuffer(buf.nbytes, huge=True)
        with open_file(path, "r", direct=True) as f:
            assert engine.submit_read(f, 0, back.view()).result() == buf.nbytes
        assert bytes(back.view()) == data
    finally:
        engine.close()


@pytest.mark.parametrize("nbytes", [HUGE_PAGE - 4096, 8192])
def test_a_small_buffer_asked_for_huge_pages_is_an_ordinary_one(nbytes: int) -> None:
    buf = AlignedBuffer(nbytes, huge=True)
    assert resident_pages(buf) == buf.capacity // mmap.PAGESIZE
