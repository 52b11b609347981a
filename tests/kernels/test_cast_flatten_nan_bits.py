"""kernels.cast_flatten writes NaNs with the bits torch's CPU ``.to()`` writes: every fp32/bf16/fp16
pair, NaNs with payloads, signs and signalling bits, at lengths that end in every vector tail — except
fp16 -> fp32, where torch's own bits depend on a NaN's position (its vector loop's tail writes
0x7FFFFFFF) and the kernel is held to NaN-for-NaN with the sign and payload kept, quieted."""

from __future__ import annotations

import pytest
import torch

import kernels

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
PAIRS = [(s, d) for s in FLOATS for d in FLOATS if s != d]
LENGTHS = [*range(1, 70), 127, 1000, 4097, 70_001]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
NAN_EXP = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _with_nans(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random bit patterns, about a third of them turned into NaNs (payload and sign kept, some signalling)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen).view(dtype).clone()
    bits = raw.view(BITS[dtype])
    nan = torch.rand(n, generator=gen) < 0.35
    nan[0] = True
    bits[nan] = bits[nan] | NAN_EXP[dtype] | 1
    return raw


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{s}-{d}".replace("torch.", "") for s, d in PAIRS])
def test_nan_bits_equal_torch(cpp_backend: None, src: torch.dtype, dst: torch.dtype) -> None:
    for k, n in enumerate(LENGTHS):
        x = _with_nans(src, n, seed=k)
        assert bool(torch.isnan(x.float()[0]))
        want = x.to(dst)
        out = torch.full((n,), 7.0, dtype=dst)
        kernels.cast_flatten([x], out)
        if (src, dst) == (torch.float16, torch.float32):
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(out), nan), n
            assert torch.equal(out.view(torch.int32)[~nan], want.view(torch.int32)[~nan]), n
            h = x.view(torch.int16)[nan].to(torch.int32) & 0xFFFF
            quiet = ((h & 0x8000) << 16) | 0x7FC00000 | ((h & 0x3FF) << 13)
            assert torch.equal(out.view(torch.int32)[nan], quiet), n
        else:
            assert torch.equal(out.view(BITS[dst]), want.view(BITS[dst])), (n, src, dst)


def test_nan_bits_in_a_flattened_batch(cpp_backend: None) -> None:
    """Several tensors back to back (each starting mid-vector in the buffer) keep torch's NaN bits."""
    xs = [_with_nans(torch.float32, n, seed=n) for n in (5, 33, 1000, 17)]
    out = torch.empty(sum(x.numel() for x in xs), dtype=torch.bfloat16)
    kernels.cast_flatten(xs, out)
    want = torch.cat([x.to(torch.bfloat16) for x in xs])
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
