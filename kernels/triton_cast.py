"""Cast + flatten many GPU tensors into one flat buffer in a single Triton launch per source dtype.

``cast_flatten(tensors, out, offsets)`` writes ``tensors[i].reshape(-1).to(out.dtype)`` into
``out[offsets[i] : offsets[i] + tensors[i].numel()]`` for every i: the staging step of a save, where a
GPU's tensors are gathered (and down-cast) into one buffer before a single device-to-host copy.
One launch covers every tensor of a source dtype (a per-block table of source address, destination
index and count, as torch's multi-tensor kernels do), so hundreds of small tensors cost one launch
rather than hundreds of ``copy_`` calls.

Numerics: fp32, bf16 and fp16 in and out. Widening is exact; narrowing rounds to nearest even and is
bit-equal to ``Tensor.to(dtype)`` (bf16 by c10's integer formula on the fp32 bits, as in
:mod:`kernels.triton_adam`; fp16 through fp32, exact for bf16 sources, then one rounding). Same-dtype
entries are plain copies. NaN stays NaN (payload not preserved).

Sources must be contiguous (a flatten of a strided view is ``reshape`` territory: pass
``t.contiguous()``); CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` for the tests.
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


@torch.no_grad()
def cast_flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    """Write each ``tensors[i]``, flattened and cast to ``out.dtype``, at ``out[offsets[i]:]`` (elements).

    ``out``: a contiguous 1-D fp32/bf16/fp16 tensor; each source: a contiguous fp32/bf16/fp16 tensor on
    ``out``'s device whose range lies inside ``out``. Ranges are the caller's plan (overlaps are not
    checked). Bad input raises ``ValueError`` naming the tensor's index.
    """
    require_triton("kernels.cast_flatten")
    check_device("kernels.cast_flatten: out", out)
    if out.dtype not in _CODE or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"kernels.cast_flatten: out must be a contiguous 1-D fp32/bf16/fp16 tensor, got {out.dtype}")
    if len(offsets) != len(tensors):
        raise ValueError(f"kernels.cast_flatten: {len(tensors)} tensors but {len(offsets)} offsets")
    groups: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.dtype not in _CODE:
            raise ValueError(f"kernels.cast_flatten: tensor {i} is {t.dtype}; expected fp32, bf16 or fp16")
        if t.device != out.device:
            raise ValueError(f"kernels.cast_flatten: tensor {i} is on {t.device}, out on {out.device}")
        if not t.is_contiguous():
            raise ValueError(f"kernels.cast_flatten: tensor {i} is not contiguous (pass t.contiguous())")
        if off < 0 or off + t.numel() > out.numel():
            raise ValueError(
                f"kernels.cast_flatten: tensor {i} ({t.numel()} elements at offset {off}) "
                f"overruns out ({out.numel()} elements)"
            )
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
                    kernel[(tab.shape[0],)](tab, o, SRC=src, DST=dst, FULL=full, BLOCK=BLOCK, num_warps=8)
