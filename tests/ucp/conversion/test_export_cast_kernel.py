"""An export with a cast (``dtype=...``) casts through ``kernels.cast_flatten`` into one buffer reused
batch after batch, and writes the bytes torch's ``.to()`` gives (NaN payloads, ±0, subnormals, every
batch size); fp16 -> fp32 stays torch's own cast; the buffer never holds more than the budget allows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import zarr
from safetensors.torch import load_file

import kernels
import ucp
from ucp.conversion.exporters import export
from ucp.conversion.exporters.zarr_export import read_tensor

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _awkward(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values plus NaNs with payloads and signs, infinities, ±0 and subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 1e3).to(dtype)
    flat = x.view(-1)
    bits = flat.view(BITS[dtype])
    n = flat.numel()
    nan = 0x7F800000 if dtype == torch.float32 else 0x7F80 if dtype == torch.bfloat16 else 0x7C00
    for k, i in enumerate(range(0, n, 37)):
        bits[i] = (nan | (k * 2654435761 % (nan // 0x80 - 1) + 1)) * (1 if k % 2 else -1)
    flat[3 % n] = -0.0
    flat[5 % n] = float("inf")
    flat[11 % n] = torch.finfo(dtype).tiny / 4
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[torch.dtype], int, torch.dtype | None]]:
    """Every kernels.cast_flatten call: (source dtypes, out's address, dtype)."""
    calls: list[tuple[list[torch.dtype], int, torch.dtype | None]] = []
    real = kernels.cast_flatten

    def wrapped(tensors: Any, out: torch.Tensor, dtype: torch.dtype | None = None, **kw: Any) -> Any:
        calls.append(([t.dtype for t in tensors], out.data_ptr(), dtype))
        return real(tensors, out, dtype, **kw)

    monkeypatch.setattr(kernels, "cast_flatten", wrapped)
    return calls


def _model() -> dict[str, torch.Tensor]:
    return {
        "a": _awkward(torch.float32, (64, 33), 1),
        "b": _awkward(torch.float32, (1000,), 2),
        "c": _awkward(torch.bfloat16, (7, 9), 3),
        "d": _awkward(torch.float16, (300,), 4),
        "e": _awkward(torch.float32, (1,), 5),
        "i": torch.arange(10, dtype=torch.int64),
        "z": torch.empty(0, 4),
    }


@pytest.mark.parametrize("budget", [1, 6000, 1 << 20], ids=["tensor-per-batch", "some-per-batch", "one-batch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_export_with_a_cast_equals_torch_and_uses_the_kernel(
    tmp_path: Path, spy: list[Any], budget: int, dtype: torch.dtype
) -> None:
    model = _model()
    ucp.save({"model": model}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "hf", dtype=str(dtype).removeprefix("torch."), memory_budget=budget)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    for k, v in model.items():
        want = v.to(dtype) if v.is_floating_point() else v
        assert _same(got[k], want), k
    cast = [k for k, v in model.items() if v.is_floating_point() and v.dtype != dtype]
    assert sorted(str(d) for c in spy for d in c[0]) == sorted(str(model[k].dtype) for k in cast)
    assert all(c[2] == dtype for c in spy)
    if budget == 1:  # one tensor per batch: the buffer is reused while it fits the batch (no regrowth)
        assert len(spy) == len(cast)


def test_zarr_export_with_a_cast_equals_torch(tmp_path: Path, spy: list[Any]) -> None:
    model = _model()
    ucp.save({"model": model}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "z", format="zarr", dtype="bf16", memory_budget=7000)
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    for k, v in model.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert _same(read_tensor(group[k]), want), k
    assert spy


def test_fp16_to_fp32_stays_torch_cast(tmp_path: Path, spy: list[Any]) -> None:
    """torch writes fp16 -> fp32 NaNs by position (kernels/cast.py): that pair is not handed to the kernel."""
    model = {"h": _awkward(torch.float16, (5, 77), 7), "g": _awkward(torch.bfloat16, (70,), 8)}
    ucp.save({"model": model}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "hf", dtype="fp32")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    for k, v in model.items():
        assert _same(got[k], v.to(torch.float32)), k
    assert [c[0] for c in spy] == [[torch.bfloat16]]


def test_one_buffer_is_reused_across_batches(tmp_path: Path, spy: list[Any]) -> None:
    """Equal batches: every batch's casts land in the same buffer (no fresh memory to fault in per batch)."""
    model = {f"w{i}": _awkward(torch.float32, (256,), i) for i in range(6)}
    ucp.save({"model": model}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "hf", dtype="bf16", memory_budget=2 * 256 * 6)  # two tensors a batch
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(_same(got[k], v.to(torch.bfloat16)) for k, v in model.items())
    assert len(spy) == 3 and len({c[1] for c in spy}) == 1
