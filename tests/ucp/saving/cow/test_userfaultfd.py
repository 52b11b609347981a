"""The userfaultfd / process_vm_readv binding (ucp/saving/cow/userfaultfd.py) on this process's own memory."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

import pytest
import torch

from ucp.saving.cow.userfaultfd import PAGE, WriteProtector, read_process_memory, unavailable

needs_uffd = pytest.mark.skipif(unavailable() is not None, reason=f"userfaultfd unavailable: {unavailable()}")


def _address(buf) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@needs_uffd
def test_a_write_to_a_protected_page_waits_until_it_is_unprotected():
    region = mmap.mmap(-1, 16 * PAGE)
    region[:] = b"\x01" * len(region)
    start = _address(region)
    t = torch.frombuffer(region, dtype=torch.uint8)
    wp = WriteProtector.create()
    try:
        wp.register(start, len(region))
        wp.protect(start + 4 * PAGE, 2 * PAGE)
        t[0] = 9  # unprotected pages are written at once
        done = threading.Event()
        # torch releases the GIL inside the op, so this thread can serve the fault
        threading.Thread(target=lambda: (t[4 * PAGE + 10 : 4 * PAGE + 20].fill_(7), done.set()), daemon=True).start()
        faults: list[int] = []
        for _ in range(2000):
            faults += wp.faults()
            if faults:
                break
            done.wait(0.005)
        assert faults and start + 4 * PAGE <= faults[0] < start + 5 * PAGE
        assert not done.is_set() and region[4 * PAGE + 10] == 1  # blocked: the page still holds its old bytes
        wp.unprotect(start + 4 * PAGE, 2 * PAGE)
        assert done.wait(30) and region[4 * PAGE + 10] == 7 and region[0] == 9
        wp.unregister(start, len(region))
    finally:
        wp.close()


@needs_uffd
def test_closing_the_descriptor_releases_blocked_writers():
    region = mmap.mmap(-1, 4 * PAGE)
    region[:] = b"\x02" * len(region)
    t = torch.frombuffer(region, dtype=torch.uint8)
    wp = WriteProtector.create()
    wp.register(_address(region), len(region))
    wp.protect(_address(region), len(region))
    done = threading.Event()
    threading.Thread(target=lambda: (t.fill_(3), done.set()), daemon=True).start()
    assert not done.wait(0.2)
    wp.close()
    assert done.wait(30) and region[:] == b"\x03" * len(region)


@needs_uffd
def test_file_mappings_cannot_be_registered(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 4 * PAGE)
    with open(path, "r+b") as f:
        region = mmap.mmap(f.fileno(), 4 * PAGE)
    wp = WriteProtector.create()
    try:
        with pytest.raises(OSError):
            wp.register(_address(region), 4 * PAGE)
    finally:
        wp.close()


def test_read_process_memory_copies_ranges_and_names_a_bad_one():
    src = bytearray(os.urandom(3 * PAGE + 5))
    dst = bytearray(len(src))
    a, b = _address(src), _address(dst)
    read_process_memory(os.getpid(), [(b, a, 100), (b + 100, a + 100, len(src) - 100)])
    assert dst == src
    with pytest.raises(OSError, match="at 0x10 of process") as err:
        read_process_memory(os.getpid(), [(b, a, 10), (b + 10, 0x10, 10)])
    assert err.value.errno == errno.EFAULT
