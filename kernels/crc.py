"""Copy bytes and compute their CRC-32C in one pass (the staging path's copy + checksum).

``copy_crc32c(dst, src, value=0)`` copies ``src`` into ``dst`` and returns ``crc32c.crc32c(src, value)``:
the C++ extension loads each 64-byte line once, stores it (with cache-bypassing streaming stores past
4 MiB, so the destination's lines are not first read in) and feeds its words to SSE4.2's crc32
instruction in three chains over three long lanes, joined in GF(2); blocks of ``GRAIN`` bytes are
handed out to ``torch.get_num_threads()`` threads and their CRCs joined. It runs at plain-copy speed
(``tools/bench_kernels.py``). The fallback (no compiler, ``UCP_KERNELS=torch``) is a copy then
``crc32c.crc32c``: two passes, same result.
"""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c
import numpy as np
import torch

from ._build import extension

GRAIN = 4 << 20  # bytes per parallel block (fewer when that would leave a thread idle)


def _view(obj: Any, name: str, writable: bool) -> np.ndarray:
    """A flat uint8 numpy view of a tensor or buffer, without copying."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError(f"copy_crc32c: {name} must be a contiguous CPU tensor")
        arr = obj.detach().view(-1).view(torch.uint8).numpy() if obj.numel() else np.empty(0, np.uint8)
    else:
        try:
            arr = np.frombuffer(obj, dtype=np.uint8)
        except (TypeError, ValueError) as e:
            raise ValueError(f"copy_crc32c: {name} ({type(obj).__name__}) is not a contiguous buffer: {e}") from e
    if writable and not arr.flags.writeable:
        raise ValueError(f"copy_crc32c: {name} is read-only")
    return arr


def _address(obj: Any, name: str, writable: bool) -> tuple[int, int, Any]:
    """``(address, nbytes, keep-alive)`` of a tensor or buffer: a tensor's own pointer (no numpy view,
    which costs microseconds a small copy cannot afford), else its numpy view's."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError(f"copy_crc32c: {name} must be a contiguous CPU tensor")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    arr = _view(obj, name, writable)
    return arr.ctypes.data, arr.nbytes, arr


def copy_crc32c(dst: Any, src: Any, value: int = 0) -> int:
    """Copy all of ``src`` into the start of ``dst`` (buffers or CPU tensors, non-overlapping) and
    return the CRC-32C of ``src`` continuing from ``value`` (as ``crc32c.crc32c(src, value)``)."""
    if not 0 <= value < 1 << 32:
        raise ValueError(f"copy_crc32c: value {value} is not a 32-bit CRC")
    ext, _ = extension()
    if ext is not None:
        s_addr, n, s_keep = _address(src, "src", False)
        d_addr, d_n, d_keep = _address(dst, "dst", True)
        if d_n < n:
            raise ValueError(f"copy_crc32c: dst holds {d_n} bytes, src has {n}")
        if n:
            crc = int(ext.copy_crc32c(d_addr, s_addr, n, value, GRAIN))
            del s_keep, d_keep  # alive until the kernel returned
            return crc
    s = _view(src, "src", False)
    d = _view(dst, "dst", True)
    if d.nbytes < s.nbytes:
        raise ValueError(f"copy_crc32c: dst holds {d.nbytes} bytes, src has {s.nbytes}")
    d[: s.nbytes] = s
    return int(_crc32c.crc32c(s.data, value))
