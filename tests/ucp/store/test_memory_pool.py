"""ucp.store.reader.MemoryPool: batch memory reused only once nothing views it any more."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ucp.store.reader import MemoryPool


def _address(buf) -> int:
    return int(np.frombuffer(buf.view(), dtype=np.uint8).ctypes.data)


def test_memory_is_reused_once_every_view_is_gone() -> None:
    pool = MemoryPool(1 << 20)
    a = pool.buffer(1 << 20)
    first = _address(a)
    del a
    b = pool.buffer(4096)  # smaller requests take a pooled mapping too
    assert _address(b) == first and b.nbytes == 4096


def test_a_live_slice_numpy_array_or_tensor_keeps_its_memory_out_of_the_pool() -> None:
    pool = MemoryPool(1 << 16)
    for keep in ("slice", "numpy", "tensor"):
        a = pool.buffer(1 << 16)
        a.view()[:] = b"\x07" * (1 << 16)
        view = a.view(100, 4096)
        held: Any = {  # a memoryview, numpy array or tensor over the pool's bytes
            "slice": view,
            "numpy": np.frombuffer(view, dtype=np.uint8),
            "tensor": torch.frombuffer(view, dtype=torch.uint8),
        }[keep]
        del a, view
        b = pool.buffer(1 << 16)
        b.view()[:] = b"\x00" * (1 << 16)  # a new user writing its buffer never touches the held bytes
        assert bytes(memoryview(held if keep != "tensor" else held.numpy())) == b"\x07" * 100, keep
        del held, b


def test_requests_larger_than_the_pool_size_get_fresh_memory() -> None:
    pool = MemoryPool(1 << 16)
    big = pool.buffer(1 << 17)
    assert big.nbytes == 1 << 17 and not pool._maps  # not pooled


def test_the_pool_holds_no_more_mappings_than_were_in_use_at_once() -> None:
    pool = MemoryPool(1 << 16)
    for _ in range(20):
        live = [pool.buffer(1 << 16) for _ in range(3)]
        del live
    assert len(pool._maps) == 3
