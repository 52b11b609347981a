"""kernels.copy_crc32c: the copy is exact and the CRC equals crc32c.crc32c, for odd sizes, continued
CRCs, thread counts and chunk sizes, tensors and buffers, and on the forced pure-torch fallback."""

from __future__ import annotations

import os
import sys

import crc32c
import pytest
import torch

import kernels

crc_module = sys.modules["kernels.crc"]
SIZES = (0, 1, 7, 8, 9, 4095, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 1, 5 * 3 * 4096 + 13, 2**20 + 3, 3 * 2**20 + 17)


@pytest.mark.parametrize("backend", ["cpp_backend", "torch_backend"])
def test_copy_and_crc_match_crc32c_on_odd_sizes(request: pytest.FixtureRequest, backend: str) -> None:
    request.getfixturevalue(backend)
    for n in SIZES:
        src = os.urandom(n)
        dst = bytearray(n + 3)
        for value in (0, 0xDEADBEEF):
            assert kernels.copy_crc32c(dst, src, value) == crc32c.crc32c(src, value), (n, value)
            assert bytes(dst[:n]) == src and dst[n:] == b"\0\0\0", n


def test_a_crc_continues_across_calls(cpp_backend: None) -> None:
    data = os.urandom(2**20 + 5)
    dst = bytearray(len(data))
    first = kernels.copy_crc32c(memoryview(dst)[:12345], data[:12345])
    whole = kernels.copy_crc32c(memoryview(dst)[12345:], data[12345:], first)
    assert whole == crc32c.crc32c(data) and bytes(dst) == data


@pytest.mark.parametrize("grain", [1, 4097, 1 << 20])
def test_thread_counts_and_chunk_sizes_agree(
    cpp_backend: None, threads: None, monkeypatch: pytest.MonkeyPatch, grain: int
) -> None:
    monkeypatch.setattr(crc_module, "GRAIN", grain)
    src = torch.randint(0, 256, (3 * 2**20 + 7,), dtype=torch.uint8)
    want = crc32c.crc32c(src.numpy().tobytes())
    for t in (1, 2, 3, 4):
        torch.set_num_threads(t)
        dst = torch.zeros_like(src)
        assert kernels.copy_crc32c(dst, src) == want, t
        assert torch.equal(dst, src), t


def test_tensors_of_any_dtype_are_copied_as_bytes(cpp_backend: None) -> None:
    src = torch.randn(1001, dtype=torch.float64)
    dst = torch.empty(1001, dtype=torch.float64)
    assert kernels.copy_crc32c(dst, src) == crc32c.crc32c(src.numpy().tobytes())
    assert torch.equal(dst, src)


@pytest.mark.parametrize("backend", ["cpp_backend", "torch_backend"])
def test_bad_buffers_are_refused_with_the_reason(request: pytest.FixtureRequest, backend: str) -> None:
    request.getfixturevalue(backend)
    with pytest.raises(ValueError, match="dst holds 3 bytes, src has 4"):
        kernels.copy_crc32c(bytearray(3), b"abcd")
    with pytest.raises(ValueError, match="dst is read-only"):
        kernels.copy_crc32c(b"xxxx", b"abcd")
    with pytest.raises(ValueError, match="src must be a contiguous CPU tensor"):
        kernels.copy_crc32c(bytearray(16), torch.zeros(8, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="value 4294967296 is not a 32-bit CRC"):
        kernels.copy_crc32c(bytearray(4), b"abcd", 1 << 32)


@pytest.mark.parametrize("backend", ["cpp_backend", "torch_backend"])
def test_unaligned_starts_and_streaming_sizes_copy_exactly(
    request: pytest.FixtureRequest, backend: str, threads: None
) -> None:
    """Past 4 MiB the copy streams (64-byte-aligned stores after a head): any src/dst misalignment."""
    request.getfixturevalue(backend)
    data = torch.randint(0, 256, ((8 << 20) + 200,), dtype=torch.uint8)
    for t in (1, 2):
        torch.set_num_threads(t)
        for n, s_off, d_off in ((8 << 20) + 13, 3, 1), ((4 << 20) + 777, 0, 63), ((4 << 20) - 1, 5, 0), (200_003, 1, 2):
            src = data[s_off : s_off + n]
            dst = torch.zeros(n + 64 + 8, dtype=torch.uint8)
            assert kernels.copy_crc32c(dst[d_off:], src) == crc32c.crc32c(src.numpy().tobytes()), (t, n, s_off, d_off)
            assert torch.equal(dst[d_off : d_off + n], src) and not dst[:d_off].any() and not dst[d_off + n :].any()
