"""Cast + flatten into one flat staging buffer in one pass, optionally with each tensor's CRC-32C.

``cast_flatten(tensors, out, dtype=None, crc=False)`` writes ``tensors``, each cast to ``dtype``
(default ``out.dtype``) and flattened in row-major order, back to back from the start of ``out``:
the bytes equal ``torch.cat([t.to(dtype).flatten() for t in tensors])``. ``out`` is any contiguous CPU
tensor with room for them (a float buffer of that dtype, or the uint8 view of a staging arena).
With ``crc=True`` it returns the CRC-32C of each tensor's written bytes (as ``crc32c.crc32c``),
computed tile by tile while the tile is still in cache, so the checksum costs no second pass.

The C++ extension handles contiguous fp32/bf16/fp16 sources into an fp32/bf16/fp16 buffer, over
``torch.get_num_threads()`` threads. NaNs come out as torch's CPU ``.to()`` writes them on x86 (bf16
0xFFFF, fp16 with the payload's top bits; fp16 -> bf16 0x7FC0), except fp16 -> fp32, where torch
itself writes a NaN by its position (0x7FFFFFFF in a vector loop's tail): the kernel quiets it. Anything else (strided or other-dtype sources, other
destination dtypes), and every tensor when the extension is unavailable, goes through torch's own
``copy_`` into the slot, then ``crc32c.crc32c`` over it: the same bytes, one pass more for the CRC.
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c as _crc32c
import torch

from ._build import extension

GRAIN = 1 << 18  # elements per parallel piece: a large tensor is split, small ones run whole
_FAST = (torch.float32, torch.bfloat16, torch.float16)


def _slot_crc(slot: torch.Tensor) -> int:
    return int(_crc32c.crc32c(slot.view(torch.uint8).numpy().data)) if slot.numel() else 0


def cast_flatten(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, dtype: torch.dtype | None = None, *, crc: bool = False
) -> list[int] | None:
    """Write every tensor of ``tensors`` cast to ``dtype`` (default ``out.dtype``) and flattened, back
    to back, from the start of ``out``; return each tensor's CRC-32C when ``crc``, else ``None``.

    ``out`` must be a contiguous CPU tensor holding at least ``sum(numel) * dtype.itemsize`` bytes,
    its data address a multiple of the itemsize; the tensors must be CPU tensors of a dtype torch can
    cast to ``dtype``. Bytes past the written ones are left alone. A CUDA ``out`` (and tensors) takes
    the Triton kernel (:mod:`kernels.triton_cast`; no ``crc`` there: checksum the host copy).
    """
    if out.device.type == "cuda":  # the Triton kernel (kernels/triton_cast.py: Triton is imported on first use)
        from .triton_cast import cast_flatten as cast_flatten_cuda

        cast_flatten_cuda(tensors, out, dtype, crc=crc)
        return None
    dtype = out.dtype if dtype is None else dtype
    if not dtype.is_floating_point:
        raise ValueError(f"kernels.cast_flatten: dtype {dtype} is not a floating-point dtype")
    if out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError("kernels.cast_flatten: out must be a contiguous CPU tensor")
    size = dtype.itemsize
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"kernels.cast_flatten: tensors[{i}] is not a CPU tensor")
    total = sum(t.numel() for t in tensors)
    nbytes = out.numel() * out.element_size()
    if nbytes < total * size:
        raise ValueError(f"kernels.cast_flatten: out holds {nbytes} bytes, the tensors need {total * size} as {dtype}")
    if out.data_ptr() % size:
        raise ValueError(f"kernels.cast_flatten: out's address is not a multiple of {dtype}'s {size}-byte itemsize")
    flat = (
        out.detach().view(-1).view(torch.uint8)[: total * size].view(dtype) if total else out.new_empty(0, dtype=dtype)
    )
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += t.numel()
    ext = extension()[0]
    fast = [
        i
        for i, t in enumerate(tensors)
        if ext is not None and dtype in _FAST and t.dtype in _FAST and t.is_contiguous() and t.numel()
    ]
    crcs: list[int] = [0] * len(tensors)
    if ext is not None and fast:
        got = ext.cast_flatten([tensors[i].detach() for i in fast], [offsets[i] for i in fast], flat, crc, GRAIN)
        for i, c in zip(fast, got):
            crcs[i] = int(c)
    done = set(fast)
    for i, t in enumerate(tensors):
        if i in done or t.numel() == 0:
            continue
        slot = flat[offsets[i] : offsets[i] + t.numel()]
        slot.view(t.shape).copy_(t.detach())
        if crc:
            crcs[i] = _slot_crc(slot)
    return crcs if crc else None
