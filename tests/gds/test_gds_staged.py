"""The staged path on host tensors: bit-exact round trips through both aio engines.

CPU tensors take the same chunked, double-buffered pipeline as CUDA tensors
(the device copy is a memcpy), so these tests cover the chunking logic without
a GPU. A small staging size forces many chunks and unaligned chunk tails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gds_helpers import engines, random_tensor, raw_bytes

import gds
from aio import AioConfig, AioError

MIB = 1 << 20

CASES = [
    pytest.param(torch.float32, (37, 129), id="float32"),
    pytest.param(torch.bfloat16, (3, 1000), id="bfloat16"),
    pytest.param(torch.float16, (2049,), id="float16-odd"),
    pytest.param(torch.float64, (4, 4, 33), id="float64"),
    pytest.param(torch.int8, (4097,), id="int8-4097-bytes"),
    pytest.param(torch.uint8, (8191,), id="uint8-8191-bytes"),
    pytest.param(torch.bool, (5, 7, 11), id="bool"),
    pytest.param(torch.int64, (), id="int64-0d"),
    pytest.param(torch.float32, (0,), id="empty"),
    pytest.param(torch.bfloat16, (3, 0, 5), id="empty-3d"),
    pytest.param(torch.complex64, (100,), id="complex64"),
    pytest.param(torch.float8_e4m3fn, (4097,), id="float8"),
    pytest.param(torch.float32, (3 * MIB // 4 + 7,), id="3MiB-plus-odd"),
]


@pytest.fixture(params=engines())
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=["default-staging", "tiny-staging"])
def handle(request: pytest.FixtureRequest, engine: str):
    if request.param == "default-staging":
        h = gds.GdsHandle(AioConfig(engine=engine, fsync=False), mode="staged")
    else:  # 12 KiB chunks against 16 KiB aio blocks: chunks straddle blocks, tails are unaligned
        h = gds.GdsHandle(AioConfig(engine=engine, block_size=16384, fsync=False), mode="staged", staging_bytes=12288)
    with h:
        assert h.mode == "staged" and h.io.engine_name == engine
        yield h


@pytest.mark.parametrize(("dtype", "shape"), CASES)
def test_round_trip_is_bit_exact(handle: gds.GdsHandle, tmp_path: Path, dtype: torch.dtype, shape: tuple) -> None:
    t = random_tensor(dtype, shape, seed=len(shape) + 7)
    path = tmp_path / "t.bin"
    nbytes = t.numel() * t.element_size()
    assert handle.write_tensor(path, t) == nbytes
    assert path.read_bytes() == raw_bytes(t)  # the file is exactly the tensor's bytes
    back = handle.read_tensor(path, dtype, shape, device="cpu")
    assert back.dtype == dtype and back.shape == t.shape and back.device.type == "cpu"
    assert raw_bytes(back) == raw_bytes(t)


@pytest.mark.parametrize("offset", [0, 4096, 4097, 12345])
def test_read_into_tensor_at_offset(handle: gds.GdsHandle, tmp_path: Path, offset: int) -> None:
    header = random_tensor(torch.uint8, (offset,), seed=1)
    t = random_tensor(torch.bfloat16, (9, 2051), seed=2)
    path = tmp_path / "packed.bin"
    path.write_bytes(raw_bytes(header) + raw_bytes(t) + b"trailing bytes")
    out = torch.full_like(t, 7.0)
    assert handle.read_into_tensor(path, out, offset=offset) == t.numel() * 2
    assert raw_bytes(out) == raw_bytes(t)
    # a slice of the payload, read from the middle of the file
    part = torch.empty(2051, dtype=torch.bfloat16)
    handle.read_into_tensor(path, part, offset=offset + 3 * 2051 * 2)
    assert raw_bytes(part) == raw_bytes(t[3])


def test_rewrite_truncates_the_old_file(handle: gds.GdsHandle, tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    handle.write_tensor(path, random_tensor(torch.float32, (50_000,)))
    small = random_tensor(torch.int16, (3,), seed=3)
    handle.write_tensor(path, small)
    assert path.read_bytes() == raw_bytes(small)


def test_views_with_offsets_and_grad_tensors(tmp_path: Path) -> None:
    base = random_tensor(torch.float32, (10, 64), seed=4)
    row = base[3]  # contiguous, but starts 3*64 elements into the storage
    leaf = random_tensor(torch.float32, (64,), seed=5).requires_grad_()
    with gds.GdsHandle(AioConfig(fsync=False), mode="staged") as h:
        h.write_tensor(tmp_path / "row.bin", row)
        assert (tmp_path / "row.bin").read_bytes() == raw_bytes(row)
        h.write_tensor(tmp_path / "leaf.bin", leaf)
        assert (tmp_path / "leaf.bin").read_bytes() == raw_bytes(leaf)
        target = torch.zeros(10, 64)
        h.read_into_tensor(tmp_path / "row.bin", target[7])
        assert raw_bytes(target[7]) == raw_bytes(row)
        assert not target[6].any() and not target[8].any()  # neighbours untouched


def test_lazy_conjugate_is_written_resolved(tmp_path: Path) -> None:
    c = random_tensor(torch.complex64, (16,), seed=6)
    with gds.GdsHandle(AioConfig(fsync=False), mode="staged") as h:
        h.write_tensor(tmp_path / "c.bin", c.conj())
        assert (tmp_path / "c.bin").read_bytes() == raw_bytes(c.conj().resolve_conj())
        with pytest.raises(ValueError, match="conj"):
            h.read_into_tensor(tmp_path / "c.bin", torch.empty(16, dtype=torch.complex64).conj())


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.arange(12.0).reshape(3, 4).t(), id="transposed"),
        pytest.param(lambda: torch.arange(20.0)[::2], id="strided"),
        pytest.param(lambda: torch.zeros(1, 4).expand(3, 4), id="expanded"),
    ],
)
def test_non_contiguous_is_a_value_error(tmp_path: Path, make) -> None:
    t = make()
    with gds.GdsHandle(mode="staged") as h:
        with pytest.raises(ValueError, match=r"not contiguous.*\.contiguous\(\)"):
            h.write_tensor(tmp_path / "x.bin", t)
        assert not (tmp_path / "x.bin").exists()
        (tmp_path / "y.bin").write_bytes(bytes(4096))
        with pytest.raises(ValueError, match=r"float32\[.*\] on cpu\) is not contiguous"):
            h.read_into_tensor(tmp_path / "y.bin", t)


def test_short_file_names_file_offset_and_sizes(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(100))
    out = torch.full((30,), 5, dtype=torch.int32)
    with gds.GdsHandle(mode="staged") as h:
        with pytest.raises(AioError) as info:
            h.read_into_tensor(path, out, offset=8)
        assert info.value.filename == str(path)
        assert "offset 8" in str(info.value) and "100 bytes" in str(info.value) and "int32[30]" in str(info.value)
        assert (out == 5).all()  # nothing was written into the tensor
        with pytest.raises(AioError) as missing:
            h.read_tensor(tmp_path / "nope.bin", torch.float32, (2,))
        assert missing.value.filename == str(tmp_path / "nope.bin")
        with pytest.raises(ValueError, match="offset must be >= 0"):
            h.read_into_tensor(path, torch.empty(1), offset=-1)


def test_failed_write_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gds import staged

    calls = {"n": 0}
    real_copy = staged._DeviceCopier.copy

    def flaky_copy(self, dst, src, slot):  # noqa: ANN001 - mirrors the patched method
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device copy failed")
        real_copy(self, dst, src, slot)

    monkeypatch.setattr(staged._DeviceCopier, "copy", flaky_copy)
    path = tmp_path / "partial.bin"
    with gds.GdsHandle(AioConfig(fsync=False), mode="staged", staging_bytes=4096) as h:
        with pytest.raises(RuntimeError, match="device copy failed"):
            h.write_tensor(path, random_tensor(torch.uint8, (40_000,)))
    assert not path.exists()


def test_auto_mode_on_this_machine_and_kvikio_request(tmp_path: Path) -> None:
    caps = gds.capabilities()
    with gds.GdsHandle() as h:
        assert h.mode == caps.auto_mode
    if caps.kvikio_usable:
        pytest.skip("kvikio is usable here; the refusal below cannot be observed")
    with pytest.raises(RuntimeError, match="mode='kvikio' is not available") as info:
        gds.GdsHandle(mode="kvikio")
    msg = str(info.value)
    assert all(r in msg for r in caps.reasons if not r.startswith("auto uses"))
    assert "auto uses" not in msg


def test_bad_mode_and_closed_handle(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be"):
        gds.GdsHandle(mode="gpu")  # type: ignore[arg-type]
    h = gds.GdsHandle(mode="staged")
    with h:
        h.write_tensor(tmp_path / "a.bin", torch.ones(3))
    h.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        h.write_tensor(tmp_path / "a.bin", torch.ones(3))
    with pytest.raises(ValueError, match="closed"):
        h.read_tensor(tmp_path / "a.bin", torch.float32, (3,))


def test_fsync_flag_is_accepted(tmp_path: Path) -> None:
    t = random_tensor(torch.float64, (1000,))
    with gds.GdsHandle(AioConfig(fsync=False), mode="staged") as h:
        for fsync in (None, True, False):
            assert h.write_tensor(tmp_path / f"f{fsync}.bin", t, fsync=fsync) == 8000
            assert os.path.getsize(tmp_path / f"f{fsync}.bin") == 8000


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.from_numpy(__import__("numpy").empty(0, "float32")), id="numpy-empty-stride-0"),
        pytest.param(lambda: torch.arange(10.0).as_strided((1,), (5,), 4), id="one-element-stride-5"),
        pytest.param(lambda: torch.arange(10.0).as_strided((2, 1), (1, 7), 2), id="size-1-dim-odd-stride"),
    ],
)
def test_contiguous_tensors_with_odd_strides(tmp_path: Path, make) -> None:
    t = make()
    with gds.GdsHandle(AioConfig(fsync=False), mode="staged") as h:
        h.write_tensor(tmp_path / "t.bin", t)
        assert (tmp_path / "t.bin").read_bytes() == raw_bytes(t)
        out = make().zero_() if t.numel() else make()
        h.read_into_tensor(tmp_path / "t.bin", out)
        assert raw_bytes(out) == raw_bytes(t)
