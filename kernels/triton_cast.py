"""Cast + flatten many GPU tensors into one flat buffer in a single Triton launch per source dtype.

:func:`cast_flatten` is what ``kernels.cast_flatten`` runs for CUDA tensors, with its API: every tensor
cast to ``dtype`` (default ``out.dtype``) and flattened, back to back from the start of ``out`` (the
bytes of ``torch.cat([t.to(dtype).flatten() for t in tensors])``); ``out`` may be a byte view of a
staging arena. :func:`cast_into` is the primitive under it, with explicit (e.g. aligned) offsets.
One launch covers every tensor of a source dtype (a per-block table of source address, destination
index and count, as torch's multi-tensor kernels do), so hundreds of small tensors cost one launch
rather than hundreds of ``copy_`` calls: the staging step of a save of GPU tensors, before a single
device-to-host copy.

Numerics: fp32, bf16 and fp16 in and out. Widening is exact; narrowing rounds to nearest even and is
bit-equal to ``Tensor.to(dtype)`` (bf16 by c10's integer formula on the fp32 bits, as in
:mod:`kernels.triton_adam`; fp16 through fp32, exact for bf16 sources, then one rounding). Same-dtype
entries are plain copies. NaN stays NaN (payload not preserved).

No CRC here (``crc=True`` is refused): a GPU save checksums the host copy (``kernels.copy_crc32c``).
CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` for the tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from .triton_adam import check_device, jit, require_triton

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    tl = None

BLOCK = 4096  # elements per program: one table row (24 bytes) read per 4096 elements moved
NUM_WARPS = 8  # 16 elements a thread
_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BITS = {0: torch.float32, 1: torch.uint16, 2: torch.float16}  # what the kernel's pointers point at


def _cast_kernel(tab_ptr, out_ptr, SRC: tl.constexpr, DST: tl.constexpr, FULL: tl.constexpr, BLOCK: tl.constexpr):
    # FULL: every row moves BLOCK elements between 16-byte-aligned addresses (the host sorts such rows
    # out): no mask, and alignment hints on the pointers, so loads and stores are 128-bit.
    row = tab_ptr + tl.program_id(0).to(tl.int64) * 3
    addr = tl.load(row)
    offs = tl.arange(0, BLOCK)
    src = addr.to(tl.pointer_type(tl.float32 if SRC == 0 else (tl.uint16 if SRC == 1 else tl.float16)))
    dst = out_ptr + tl.load(row + 1)
    if FULL:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        mask = None
    else:
        mask = offs < tl.load(row + 2)
    x = tl.load(src + offs, mask=mask)
    if SRC == 1:  # bf16 bits: widening is a shift
        h = x
        x = (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    if DST == 0:
        tl.store(dst + offs, x.to(tl.float32), mask=mask)
    elif DST == 1:
        if SRC == 1:
            tl.store(dst + offs, h, mask=mask)
        else:  # c10's round to nearest even on the bits (NaN -> 0x7FC0)
            f = x.to(tl.float32)
            bits = f.to(tl.uint32, bitcast=True)
            r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            r = tl.where(f != f, 0x7FC0, r)
            tl.store(dst + offs, r.to(tl.uint16), mask=mask)
    else:
        if SRC == 2:
            tl.store(dst + offs, x, mask=mask)
        else:
            tl.store(dst + offs, x.to(tl.float32).to(tl.float16), mask=mask)


def _table(tensors: list[torch.Tensor], offsets: list[int], out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of (source address, destination index, count), one per BLOCK-element block, on ``out``'s
    device: ``(full, rest)``, where ``full`` holds the whole blocks of tensors whose source and
    destination both start 16-byte aligned (what the unmasked, vectorised launch needs)."""
    counts = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    addrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    esize = torch.tensor([t.element_size() for t in tensors], dtype=torch.int64)
    dsts = torch.tensor(offsets, dtype=torch.int64)
    aligned = (addrs % 16 == 0) & ((out.data_ptr() + dsts * out.element_size()) % 16 == 0)
    nblk = (counts + BLOCK - 1) // BLOCK
    tid = torch.repeat_interleave(torch.arange(len(tensors)), nblk)
    first = torch.cumsum(nblk, 0) - nblk
    start = (torch.arange(int(nblk.sum())) - first[tid]) * BLOCK
    cnt = (counts[tid] - start).clamp(max=BLOCK)
    rows = torch.stack([addrs[tid] + start * esize[tid], dsts[tid] + start, cnt], 1)
    full = aligned[tid] & (cnt == BLOCK)
    return rows[full].contiguous().to(out.device), rows[~full].contiguous().to(out.device)


def _check_into(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    if out.dtype not in _CODE or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"kernels.cast_into: out must be a contiguous 1-D fp32/bf16/fp16 tensor, got {out.dtype}")
    if len(offsets) != len(tensors):
        raise ValueError(f"kernels.cast_into: {len(tensors)} tensors but {len(offsets)} offsets")
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.dtype not in _CODE:
            raise ValueError(f"kernels.cast_into: tensor {i} is {t.dtype}; expected fp32, bf16 or fp16")
        if t.device != out.device:
            raise ValueError(f"kernels.cast_into: tensor {i} is on {t.device}, out on {out.device}")
        if not t.is_contiguous():
            raise ValueError(f"kernels.cast_into: tensor {i} is not contiguous (pass t.contiguous())")
        if off < 0 or off + t.numel() > out.numel():
            raise ValueError(
                f"kernels.cast_into: tensor {i} ({t.numel()} elements at offset {off}) "
                f"overruns out ({out.numel()} elements)"
            )


@torch.no_grad()
def cast_into(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    """Write each ``tensors[i]``, flattened and cast to ``out.dtype``, at ``out[offsets[i]:]`` (elements).

    ``out``: a contiguous 1-D fp32/bf16/fp16 tensor; each source: a contiguous fp32/bf16/fp16 tensor on
    ``out``'s device whose range lies inside ``out``. Ranges are the caller's plan (overlaps are not
    checked). Bad input raises ``ValueError`` naming the tensor's index.
    """
    require_triton("kernels.cast_into")
    check_device("kernels.cast_into: out", out)
    _check_into(tensors, out, offsets)
    groups: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
    for t, off in zip(tensors, offsets):
        if t.numel():
            ts, os_ = groups.setdefault(_CODE[t.dtype], ([], []))
            ts.append(t)
            os_.append(int(off))
    dst = _CODE[out.dtype]
    o = out.view(_BITS[dst])
    kernel = jit(_cast_kernel)
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        for src, (ts, os_) in groups.items():
            for full, tab in zip((True, False), _table(ts, os_, out)):
                if tab.shape[0]:
                    kernel[(tab.shape[0],)](
                        tab, o, SRC=src, DST=dst, FULL=full, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False
                    )


@torch.no_grad()
def cast_flatten(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, dtype: torch.dtype | None = None, *, crc: bool = False
) -> None:
    """``kernels.cast_flatten`` for CUDA tensors: each tensor cast to ``dtype`` (default ``out.dtype``)
    and flattened, back to back from the start of ``out`` (any contiguous tensor with room for them,
    its address a multiple of the itemsize). Contiguous fp32/bf16/fp16 sources into an fp32/bf16/fp16
    buffer take the Triton kernel; any other source or destination dtype, and strided sources, take
    torch's ``copy_`` into their slot (the same bytes). Bytes past the written ones are left alone.
    """
    require_triton("kernels.cast_flatten")
    check_device("kernels.cast_flatten: out", out)
    if crc:
        raise ValueError(
            "kernels.cast_flatten: crc=True is CPU-only; on the GPU checksum the host copy (kernels.copy_crc32c)"
        )
    dtype = out.dtype if dtype is None else dtype
    if not dtype.is_floating_point:
        raise ValueError(f"kernels.cast_flatten: dtype {dtype} is not a floating-point dtype")
    if not out.is_contiguous():
        raise ValueError("kernels.cast_flatten: out must be a contiguous tensor")
    size = dtype.itemsize
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.device != out.device:
            raise ValueError(f"kernels.cast_flatten: tensors[{i}] is not a tensor on {out.device}")
    total = sum(t.numel() for t in tensors)
    nbytes = out.numel() * out.element_size()
    if nbytes < total * size:
        raise ValueError(f"kernels.cast_flatten: out holds {nbytes} bytes, the tensors need {total * size} as {dtype}")
    if out.data_ptr() % size:
        raise ValueError(f"kernels.cast_flatten: out's address is not a multiple of {dtype}'s {size}-byte itemsize")
    if total == 0:
        return
    flat = out.detach().view(-1).view(torch.uint8)[: total * size].view(dtype)
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += t.numel()
    fast = [i for i, t in enumerate(tensors) if dtype in _CODE and t.dtype in _CODE and t.is_contiguous()]
    if fast:
        cast_into([tensors[i].detach() for i in fast], flat, [offsets[i] for i in fast])
    done = set(fast)
    for i, t in enumerate(tensors):
        if i not in done and t.numel():
            flat[offsets[i] : offsets[i] + t.numel()].view(t.shape).copy_(t.detach())
