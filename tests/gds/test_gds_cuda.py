"""CUDA tensors through both paths. Skipped without a GPU (CI has none); run on a GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gds_helpers import random_tensor, raw_bytes

import gds
from aio import AioConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.float64]
SHAPES = [(), (0,), (4097,), (3, 1 << 19)]


def _kvikio_usable() -> bool:
    return gds.capabilities().kvikio_usable


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_staged_cuda_round_trip(tmp_path: Path, dtype: torch.dtype, shape: tuple) -> None:
    t = random_tensor(dtype, shape).cuda()
    with gds.GdsHandle(AioConfig(fsync=False), mode="staged", staging_bytes=1 << 20) as h:
        assert h._staged.pinned in (None, True)
        h.write_tensor(tmp_path / "t.bin", t)
        assert (tmp_path / "t.bin").read_bytes() == raw_bytes(t)
        back = h.read_tensor(tmp_path / "t.bin", dtype, shape, device="cuda", offset=0)
        assert back.is_cuda and raw_bytes(back) == raw_bytes(t)


def test_staged_waits_for_pending_kernels(tmp_path: Path) -> None:
    # The tensor is produced by a kernel still queued on the current stream when write_tensor starts.
    x = torch.randn(1 << 22, device="cuda")
    y = (x * 3 + 1).sin()
    with gds.GdsHandle(AioConfig(fsync=False), mode="staged", staging_bytes=1 << 20) as h:
        h.write_tensor(tmp_path / "y.bin", y)
        assert (tmp_path / "y.bin").read_bytes() == raw_bytes(y)


@pytest.mark.skipif(not _kvikio_usable(), reason="kvikio not usable here (see python -m gds)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvikio_round_trip_and_cross_path(tmp_path: Path, dtype: torch.dtype) -> None:
    t = random_tensor(dtype, (3, 4097)).cuda()
    with gds.GdsHandle(AioConfig(fsync=False), mode="kvikio") as kv, gds.GdsHandle(mode="staged") as st:
        assert kv.mode == "kvikio"
        kv.write_tensor(tmp_path / "k.bin", t)
        assert (tmp_path / "k.bin").read_bytes() == raw_bytes(t)
        assert raw_bytes(st.read_tensor(tmp_path / "k.bin", dtype, t.shape, device="cuda")) == raw_bytes(t)
        st.write_tensor(tmp_path / "s.bin", t)
        assert raw_bytes(kv.read_tensor(tmp_path / "s.bin", dtype, t.shape, device="cuda")) == raw_bytes(t)
        part = torch.empty(4097, dtype=dtype, device="cuda")
        kv.read_into_tensor(tmp_path / "k.bin", part, offset=t[0].numel() * t.element_size())
        assert raw_bytes(part) == raw_bytes(t[1])
