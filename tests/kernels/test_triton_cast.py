"""The Triton cast + flatten kernel on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``
set per test): every fp32/bf16/fp16 pair equals ``Tensor.to`` bit for bit, aligned (vectorised) and
unaligned blocks alike, one launch per source dtype; ``cast_flatten`` writes the bytes the CPU
``kernels.cast_flatten`` writes; bad input names the tensor at fault."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kernels
from kernels import triton_adam, triton_cast

pytestmark = pytest.mark.skipif(not triton_adam.available()[0], reason=f"no Triton here: {triton_adam.available()[1]}")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
B = triton_cast.BLOCK


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton's interpreter for this test only (kernels are built per mode on first use)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _values(n: int, seed: int) -> torch.Tensor:
    """Normal values with ties, infinities, zeros and fp16 overflow/subnormals mixed in."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 100
    special = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x477FF000, 0x33800001, 0x80000000, 0x7F800000])
    k = min(n, special.numel())
    x[:k] = special[:k].to(torch.int32).view(torch.float32)
    return x


def _plan(sizes: list[int], pad: int) -> tuple[list[int], int]:
    offsets, o = [], 0
    for s in sizes:
        offsets.append(o)
        o += s + pad
    return offsets, o


def _check(tensors: list[torch.Tensor], out: torch.Tensor, offsets: list[int], fill: torch.Tensor) -> None:
    covered = torch.zeros(out.numel(), dtype=torch.bool)
    for i, (t, a) in enumerate(zip(tensors, offsets)):
        want = t.reshape(-1).to(out.dtype)
        got = out[a : a + t.numel()]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"tensor {i} {t.dtype} -> {out.dtype}"
        covered[a : a + t.numel()] = True
    assert torch.equal(out[~covered].view(torch.uint8), fill[~covered].view(torch.uint8)), "wrote outside the plan"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy: fp16 overflow -> inf
@pytest.mark.parametrize("dst", DTYPES)
def test_every_dtype_pair_equals_tensor_to(interpret: None, dst: torch.dtype) -> None:
    """Whole aligned blocks (the vectorised launch), tails and tiny tensors, from each source dtype."""
    sizes = [1, 7, B, 2 * B + 3, 0, 5 * 3]
    tensors = [_values(s, i).to(DTYPES[i % 3]) for i, s in enumerate(sizes)]
    tensors[-1] = tensors[-1].reshape(5, 3)
    offsets, total = _plan(sizes, pad=64)  # 64-element pads keep every start 16-byte aligned
    fill = torch.full((total,), -3.0).to(dst)
    out = fill.clone()
    triton_cast.cast_into(tensors, out, offsets)
    _check(tensors, out, offsets, fill)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dst", DTYPES)
def test_unaligned_sources_and_destinations(interpret: None, dst: torch.dtype) -> None:
    """Sources one element into their storage, destinations at odd offsets: the masked launch only."""
    tensors = [_values(B + 9, 40 + i).to(DTYPES[i])[1:] for i in range(3)]
    offsets, total = _plan([t.numel() for t in tensors], pad=3)
    offsets = [o + 1 for o in offsets]
    fill = torch.full((total + 1,), 9.0).to(dst)
    out = fill.clone()
    triton_cast.cast_into(tensors, out, offsets)
    _check(tensors, out, offsets, fill)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_random_bits_round_like_torch(interpret: None) -> None:
    bits = torch.randint(-(2**31), 2**31, (3 * B + 5,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    for dst in (torch.bfloat16, torch.float16):
        out = torch.empty(x.numel(), dtype=dst)
        triton_cast.cast_into([x], out, [0])
        assert torch.equal(out.view(torch.int16), x.to(dst).view(torch.int16)), dst
    nan = torch.full((5,), float("nan"))
    for dst in DTYPES:
        out = torch.zeros(5, dtype=dst)
        triton_cast.cast_into([nan, nan.to(dst)], torch.zeros(10, dtype=dst), [0, 5])
        triton_cast.cast_into([nan], out, [0])
        assert bool(out.isnan().all()), dst


def test_one_launch_per_source_dtype_and_kind_of_block(interpret: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many tensors of one dtype: at most two launches (whole aligned blocks, then the rest)."""
    grids: list[tuple[Any, ...]] = []
    real = triton_cast.jit

    class Counting:
        def __init__(self, k: Any) -> None:
            self.k = k

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            grids.append(grid)
            return self.k[grid]

    monkeypatch.setattr(triton_cast, "jit", lambda fn: Counting(real(fn)))
    tensors = [torch.randn(s) for s in [3, B, 100, 2 * B, 1, 17] * 5]
    offsets, total = _plan([t.numel() for t in tensors], pad=61)
    out = torch.zeros(total, dtype=torch.bfloat16)
    triton_cast.cast_into(tensors, out, offsets)
    _check(tensors, out, offsets, torch.zeros(total, dtype=torch.bfloat16))
    assert len(grids) == 2 and sum(g[0] for g in grids) == sum((t.numel() + B - 1) // B for t in tensors)


def test_bad_input_names_the_tensor(interpret: None) -> None:
    out = torch.zeros(64)
    with pytest.raises(ValueError, match="tensor 1 is not contiguous"):
        triton_cast.cast_into([torch.zeros(2), torch.zeros(4, 4).t()], out, [0, 8])
    with pytest.raises(ValueError, match="tensor 0 is torch.int32; expected fp32, bf16 or fp16"):
        triton_cast.cast_into([torch.zeros(2, dtype=torch.int32)], out, [0])
    with pytest.raises(ValueError, match=r"tensor 1 \(10 elements at offset 60\) overruns out \(64 elements\)"):
        triton_cast.cast_into([torch.zeros(2), torch.zeros(10)], out, [0, 60])
    with pytest.raises(ValueError, match="2 tensors but 1 offsets"):
        triton_cast.cast_into([torch.zeros(2), torch.zeros(2)], out, [0])
    with pytest.raises(ValueError, match="out must be a contiguous 1-D fp32/bf16/fp16 tensor, got torch.float64"):
        triton_cast.cast_into([torch.zeros(2)], torch.zeros(8, dtype=torch.float64), [0])


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"kernels.cast_into: out: the Triton kernels take CUDA tensors"):
        triton_cast.cast_into([torch.zeros(2)], torch.zeros(2), [0])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_flatten_writes_the_bytes_of_the_cpu_kernel(interpret: None, dtype: torch.dtype) -> None:
    """kernels.cast_flatten's API: back to back from the start of a byte arena, ``dtype`` given apart,
    strided and non-float sources through torch's copy_, bytes past the written ones untouched."""
    gen = torch.Generator().manual_seed(5)
    tensors = [_values(B + 5, 1).to(torch.bfloat16), torch.randn(33, 7, generator=gen).t(), _values(9, 2)]
    tensors += [torch.arange(-5, 6, dtype=torch.int32), _values(2 * B, 3).to(torch.float16), torch.zeros(0)]
    need = sum(t.numel() for t in tensors) * dtype.itemsize
    arena = torch.full((need + 100,), 0xAB, dtype=torch.uint8)
    want = arena.clone()
    triton_cast.cast_flatten(tensors, arena, dtype)
    kernels.cast_flatten(tensors, want, dtype)  # the CPU implementation (C++ or torch)
    assert torch.equal(arena, want)
    assert torch.equal(arena[:need].view(dtype), torch.cat([t.to(dtype).flatten() for t in tensors]))
    assert bool((arena[need:] == 0xAB).all())


def test_cast_flatten_refuses_what_it_cannot_do(interpret: None) -> None:
    out = torch.zeros(8)
    with pytest.raises(ValueError, match=r"crc=True is CPU-only; on the GPU checksum the host copy"):
        triton_cast.cast_flatten([torch.zeros(2)], out, crc=True)
    with pytest.raises(ValueError, match="out holds 32 bytes, the tensors need 36 as torch.float32"):
        triton_cast.cast_flatten([torch.zeros(9)], out)
    with pytest.raises(ValueError, match="dtype torch.int32 is not a floating-point dtype"):
        triton_cast.cast_flatten([torch.zeros(2)], out, torch.int32)
    with pytest.raises(ValueError, match="out's address is not a multiple of torch.float32's 4-byte itemsize"):
        triton_cast.cast_flatten([torch.zeros(2)], torch.zeros(64, dtype=torch.uint8)[1:], torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel runs on a GPU only")
def test_kernels_cast_flatten_dispatches_cuda_tensors_to_triton() -> None:
    tensors = [torch.randn(3 * B + 1, device="cuda"), torch.randn(100, device="cuda").to(torch.float16)]
    out = torch.empty(3 * B + 101, dtype=torch.bfloat16, device="cuda")
    kernels.cast_flatten(tensors, out)
    assert torch.equal(out.cpu(), torch.cat([t.to(torch.bfloat16).flatten() for t in tensors]).cpu())
