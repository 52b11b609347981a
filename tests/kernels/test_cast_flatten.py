"""kernels.cast_flatten: the bytes equal torch.cat of the casts (every fp32/bf16/fp16 pair, rounding
edges, strided and other-dtype sources), the per-tensor CRC-32C equals crc32c.crc32c of each slot,
a uint8 staging buffer works, bad arguments are refused naming the fault, on both backends."""

from __future__ import annotations

import sys

import crc32c
import pytest
import torch

import kernels

cast_module = sys.modules["kernels.cast"]
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ["cpp_backend", "torch_backend"]


def _values(n: int, seed: int) -> torch.Tensor:
    """Normal values plus the edges a cast rounds: ties, subnormals of each format, overflow, inf, ±0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-30, 6, n).index_select(0, torch.randperm(n, generator=gen))
    edges = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65520.0, 1e5, 6e-8, 5.9e-8, 3e-8, 1e-39, -1e-40, 3.4e38,
         1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 2**-24, 2**-25, 2**-126, 2**-133]
    )  # fmt: skip
    return torch.cat([edges, x])[:n]


def _expected(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([t.to(dtype).flatten() for t in tensors])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_bytes_equal_torch_cat_of_the_casts(
    request: pytest.FixtureRequest, backend: str, src: torch.dtype, dst: torch.dtype
) -> None:
    request.getfixturevalue(backend)
    tensors = [_values(n, n).to(src).reshape(shape) for n, shape in ((21, (21,)), (1, (1,)), (4096 * 3 + 7, (5, -1)))]
    tensors.insert(1, torch.empty(0, 3, dtype=src))
    out = torch.full((sum(t.numel() for t in tensors) + 5,), 7, dtype=dst)
    crcs = kernels.cast_flatten(tensors, out, crc=True)
    want = _expected(tensors, dst)
    assert torch.equal(_bits(out[: want.numel()]), _bits(want)), (src, dst)
    assert torch.equal(out[want.numel() :], torch.full((5,), 7, dtype=dst)), "bytes past the written ones changed"
    at, slots = 0, []
    for t in tensors:
        slots.append(crc32c.crc32c(want[at : at + t.numel()].view(torch.uint8).numpy().tobytes()))
        at += t.numel()
    assert crcs == slots
    assert kernels.cast_flatten(tensors, out) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_stays_nan_and_infinities_keep_their_sign(request: pytest.FixtureRequest, backend: str) -> None:
    request.getfixturevalue(backend)
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6, -1e6])
    for dst in (torch.bfloat16, torch.float16):
        out = torch.empty(5, dtype=dst)
        kernels.cast_flatten([x], out)
        assert torch.isnan(out[0]) and torch.equal(out[1:], x[1:].to(dst)), dst


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_other_dtype_sources_go_through_torch_with_the_same_bytes(
    request: pytest.FixtureRequest, backend: str
) -> None:
    request.getfixturevalue(backend)
    base = torch.randn(64, 33)
    tensors = [base.t(), base[::2, 1:], torch.randn(99, dtype=torch.float64), torch.arange(10), base[:3]]
    out = torch.empty(sum(t.numel() for t in tensors), dtype=torch.bfloat16)
    crcs = kernels.cast_flatten(tensors, out, crc=True)
    want = _expected(tensors, torch.bfloat16)
    assert torch.equal(_bits(out), _bits(want))
    assert crcs is not None and crcs[0] == crc32c.crc32c(
        _bits(base.t().to(torch.bfloat16).contiguous()).numpy().tobytes()
    )
    out64 = torch.empty(base.numel(), dtype=torch.float64)
    kernels.cast_flatten([base], out64)
    assert torch.equal(out64, base.double().flatten())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_uint8_staging_buffer_takes_the_bytes_at_an_aligned_offset(
    request: pytest.FixtureRequest, backend: str
) -> None:
    request.getfixturevalue(backend)
    tensors = [torch.randn(1000, 3), torch.randn(17, dtype=torch.float16)]
    arena = torch.zeros(1 << 16, dtype=torch.uint8)
    slot = arena[4096:]
    kernels.cast_flatten(tensors, slot, torch.float16)
    want = _expected(tensors, torch.float16).view(torch.uint8)
    assert torch.equal(slot[: want.numel()], want) and not arena[:4096].any() and not slot[want.numel() :].any()


@pytest.mark.parametrize("grain", [1, 4097, 1 << 20])
def test_pieces_and_thread_counts_give_the_same_bytes_and_crcs(
    cpp_backend: None, threads: None, monkeypatch: pytest.MonkeyPatch, grain: int
) -> None:
    monkeypatch.setattr(cast_module, "GRAIN", grain)
    tensors = [_values(2**17 + 3, 1), _values(5, 2).to(torch.bfloat16), _values(3 * 4096 + 1, 3).to(torch.float16)]
    want = _expected(tensors, torch.bfloat16)
    ref = None
    for t in (1, 2, 3):
        torch.set_num_threads(t)
        out = torch.empty(want.numel(), dtype=torch.bfloat16)
        crcs = kernels.cast_flatten(tensors, out, crc=True)
        assert torch.equal(_bits(out), _bits(want)), (grain, t)
        ref = ref or crcs
        assert crcs == ref, (grain, t)
    assert ref == [crc32c.crc32c(_bits(x.to(torch.bfloat16)).numpy().tobytes()) for x in tensors]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_are_refused_naming_the_fault(request: pytest.FixtureRequest, backend: str) -> None:
    request.getfixturevalue(backend)
    x = torch.ones(8)
    with pytest.raises(ValueError, match=r"out holds 30 bytes, the tensors need 32 as torch.float32"):
        kernels.cast_flatten([x], torch.empty(30, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="out must be a contiguous CPU tensor"):
        kernels.cast_flatten([x], torch.empty(64)[::2])
    with pytest.raises(ValueError, match=r"tensors\[1\] is not a CPU tensor"):
        kernels.cast_flatten([x, "weights"], torch.empty(64))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="dtype torch.int32 is not a floating-point dtype"):
        kernels.cast_flatten([x], torch.empty(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="not a multiple of torch.float32's 4-byte itemsize"):
        kernels.cast_flatten([x], torch.empty(64, dtype=torch.uint8)[1:], torch.float32)
