"""AlignedBuffer is page-aligned and shares its memory with every view; BufferPool bounds and reuses buffers."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest
import torch

from aio import AlignedBuffer, BufferPool

PAGE = mmap.PAGESIZE


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 5000, 3 * (1 << 20) + 1])
def test_aligned_buffer_address_and_size(nbytes):
    buf = AlignedBuffer(nbytes, pin=False)
    assert buf.address % PAGE == 0
    assert len(buf) == nbytes and buf.view().nbytes == nbytes
    assert buf.capacity >= max(nbytes, 1) and buf.capacity % PAGE == 0
    assert buf.pinned is False
    if nbytes:
        assert buf.numpy().ctypes.data == buf.address
        assert buf.tensor().data_ptr() == buf.address
    else:
        assert buf.tensor().numel() == 0 and buf.numpy().size == 0


def test_views_share_memory():
    buf = AlignedBuffer(10_000, pin=False)
    arr, t, mv = buf.numpy(), buf.tensor(), buf.view()
    arr[:] = np.arange(10_000) % 251
    assert t[9_999].item() == 9_999 % 251 and mv[3] == 3  # numpy -> torch, memoryview
    t[17] = 200
    assert arr[17] == 200  # torch -> numpy
    mv[5000:5004] = b"abcd"
    assert bytes(arr[5000:5004]) == b"abcd" and bytes(t[5000:5004].numpy()) == b"abcd"
    # offset views point into the same memory
    sub = buf.numpy(100, offset=4096)
    assert sub.ctypes.data == buf.address + 4096
    sub[:] = 9
    assert (arr[4096:4196] == 9).all()
    assert buf.tensor(8, offset=16).data_ptr() == buf.address + 16


def test_view_bounds_and_resize():
    buf = AlignedBuffer(5000, pin=False)
    assert buf.capacity == 8192
    assert buf.view(8192).nbytes == 8192  # up to the capacity is allowed
    with pytest.raises(ValueError):
        buf.view(8193)
    with pytest.raises(ValueError):
        buf.view(10, offset=-1)
    buf.resize(6000)
    assert len(buf) == 6000 and buf.numpy().size == 6000
    with pytest.raises(ValueError):
        buf.resize(8193)
    with pytest.raises(ValueError):
        AlignedBuffer(-1)


def test_pool_reuses_and_bounds_buffers():
    pool = BufferPool(5000, max_buffers=3, pin=False)
    assert pool.buffer_size == 8192
    bufs = [pool.acquire() for _ in range(3)]
    assert len({id(b) for b in bufs}) == 3 and pool.created == 3
    assert all(b.address % PAGE == 0 and len(b) == 8192 for b in bufs)
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.05)
    bufs[1].resize(10)
    pool.release(bufs[1])
    again = pool.acquire(timeout=1)
    assert again is bufs[1] and len(again) == 8192  # reused, at full size again
    assert pool.created == 3
    with pytest.raises(ValueError):
        BufferPool(4096, max_buffers=0)


def test_pool_acquire_blocks_until_a_release():
    pool = BufferPool(4096, max_buffers=1, pin=False)
    held = pool.acquire()
    got: list[AlignedBuffer] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=30)))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # blocked: the only buffer is out
    pool.release(held)
    waiter.join(timeout=30)
    assert got == [held]


def test_pool_reserve_widens_and_narrows_the_bound():
    pool = BufferPool(4096, max_buffers=1, pin=False)
    a = pool.acquire()
    pool.reserve(1)
    b = pool.acquire(timeout=1)
    assert b is not a and pool.created == 2
    pool.reserve(-1)
    pool.release(b)
    assert pool.acquire(timeout=1) is b
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.05)


def test_tensor_view_survives_as_a_zero_copy_tensor():
    buf = AlignedBuffer(4 * 1024, pin=False)
    t = buf.tensor().view(torch.float32)  # reinterpreting keeps sharing
    t[:] = 1.5
    assert np.frombuffer(buf.view(), dtype=np.float32)[0] == 1.5
