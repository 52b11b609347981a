"""Bytes written through either engine come back bit-exact, whatever the size, offset or buffer address."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from aio import AioConfig, AioHandle, AlignedBuffer, libaio_status

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SIZES = [0, 1, 4095, 4096, 4097, 3 * MIB + 7, 9 * MIB + 4093]


def disk_bytes(path: Path) -> bytes:
    """The file as the page cache sees it, independent of the aio read path."""
    with open(path, "rb") as f:
        return f.read()


def as_source(data: np.ndarray, kind: str):
    """The same bytes as bytes, a plain numpy array, or a page-aligned buffer (the writer's zero-copy path)."""
    if kind == "bytes":
        return data.tobytes()
    if kind == "numpy":
        return data
    buf = AlignedBuffer(data.nbytes, pin=False)
    buf.numpy()[:] = data
    return buf.view()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("source", ["bytes", "numpy", "aligned"])
def test_write_file_read_file(engine, disk_dir, make_data, size, source):
    data = make_data(size, seed=size)
    path = disk_dir / "f.bin"
    with AioHandle(AioConfig(engine=engine, block_size=1 * MIB, queue_depth=4)) as io:
        assert io.engine_name == engine
        assert io.write_file(path, as_source(data, source)) == size
        assert os.path.getsize(path) == size
        assert disk_bytes(path) == data.tobytes()
        buf = io.read_file(path)
        assert buf.address % 4096 == 0
        assert len(buf) == size
        assert np.array_equal(buf.numpy(), data)


def test_write_file_from_parts_and_reuse_read_buffer(engine, disk_dir, make_data):
    parts = [make_data(n, seed=n) for n in (5, 4096, 0, 1 * MIB + 1, 3, 2 * MIB)]
    whole = np.concatenate(parts)
    with AioHandle(AioConfig(engine=engine, block_size=256 * KIB)) as io:
        assert io.write_file(disk_dir / "parts.bin", parts) == whole.nbytes
        out = AlignedBuffer(8 * MIB, pin=False)
        got = io.read_file(disk_dir / "parts.bin", out=out)
        assert got is out and len(out) == whole.nbytes
        assert np.array_equal(out.numpy(), whole)
        io.write_file(disk_dir / "small.bin", parts[0])
        assert io.read_file(disk_dir / "small.bin", out=out) is out and out.numpy().tobytes() == parts[0].tobytes()


@pytest.mark.parametrize("size_hint", [None, "exact"])
def test_streaming_writer_many_uneven_writes(engine, disk_dir, make_data, size_hint):
    data = make_data(5 * MIB + 12345, seed=7)
    cycle = [1, 7, 4095, 4096, 4097, 100_003, 3, 65_537, 0, 1_048_577, 511, 12_288]
    with AioHandle(AioConfig(engine=engine, block_size=64 * KIB, queue_depth=8)) as io:
        hint = data.nbytes if size_hint == "exact" else None
        with io.writer(disk_dir / "s.bin", size_hint=hint) as w:
            pos, i = 0, 0
            while pos < data.nbytes:
                n = cycle[i % len(cycle)]
                chunk = data[pos : pos + n]
                kind = i % 3  # vary the buffer type the writer is given
                w.write(chunk if kind == 0 else memoryview(chunk) if kind == 1 else chunk.tobytes())
                pos, i = pos + n, i + 1
            assert w.size == data.nbytes
        assert os.path.getsize(disk_dir / "s.bin") == data.nbytes
        assert disk_bytes(disk_dir / "s.bin") == data.tobytes()


def test_writer_does_not_keep_callers_memory(engine, disk_dir):
    """write() may be handed one reused buffer: the file must hold what it held at each call."""
    bs = 64 * KIB
    src = AlignedBuffer(bs, pin=False)  # aligned and block-sized: eligible for zero-copy submission
    arr = src.numpy()
    with AioHandle(AioConfig(engine=engine, block_size=bs, queue_depth=16)) as io:
        with io.writer(disk_dir / "reuse.bin") as w:
            for i in range(48):
                arr[:] = i
                w.write(arr)
        got = np.fromfile(disk_dir / "reuse.bin", dtype=np.uint8).reshape(48, bs)
        assert np.array_equal(got, np.repeat(np.arange(48, dtype=np.uint8)[:, None], bs, axis=1))


def test_write_from_read_only_aligned_memory(engine, disk_dir, make_data):
    """Read-only sources (e.g. a read-only mmap of another file) are written, not refused."""
    data = make_data(3 * MIB + 1, seed=3)
    src = AlignedBuffer(data.nbytes, pin=False)
    src.numpy()[:] = data
    with AioHandle(AioConfig(engine=engine, block_size=1 * MIB)) as io:
        io.write_file(disk_dir / "ro.bin", src.view().toreadonly())
    assert disk_bytes(disk_dir / "ro.bin") == data.tobytes()


def test_read_into_unaligned_offsets_and_destinations(engine, disk_dir, make_data):
    size = 3 * MIB + 333
    data = make_data(size, seed=11)
    path = disk_dir / "r.bin"
    with AioHandle(AioConfig(engine=engine, block_size=256 * KIB, queue_depth=4)) as io:
        io.write_file(path, data)
        offsets = [0, 1, 511, 4095, 4096, 4097, 256 * KIB - 3, MIB + 1]
        lengths = [1, 3, 4095, 4096, 4097, 256 * KIB + 1, MIB + 5]
        backing = np.zeros(2 * MIB + 8192, dtype=np.uint8)
        aligned = AlignedBuffer(2 * MIB, pin=False)
        for off in offsets:
            for n in lengths:
                # destination starting at byte 1 of a numpy array: never page-aligned
                dest = backing[1 : 1 + n]
                dest[:] = 0
                assert io.read_into(path, off, dest) == n
                assert np.array_equal(dest, data[off : off + n]), (off, n)
                # page-aligned destination: direct reads where the offset allows, staged tail otherwise
                adest = aligned.numpy(n)
                adest[:] = 0
                io.read_into(path, off, adest)
                assert np.array_equal(adest, data[off : off + n]), (off, n)
        # up to the very last byte, and into a torch tensor through its numpy view
        t = torch.zeros(5000, dtype=torch.uint8)
        io.read_into(path, size - 5000, t.numpy())
        assert bytes(t.numpy()) == data[-5000:].tobytes()
        assert io.read_into(path, size, bytearray(0)) == 0


def test_read_ranges_many(engine, disk_dir, make_data):
    size = 4 * MIB + 17
    data = make_data(size, seed=5)
    path = disk_dir / "ranges.bin"
    rng = np.random.default_rng(99)
    with AioHandle(AioConfig(engine=engine, block_size=128 * KIB, queue_depth=8)) as io:
        io.write_file(path, data)
        ranges = []
        for i in range(400):
            n = int(rng.integers(1, 300 * KIB))
            off = int(rng.integers(0, size - n + 1))
            if i % 4 == 0:  # some aligned ones, straight into page-aligned memory
                off -= off % 4096
                dest = AlignedBuffer(n, pin=False).numpy()
            else:
                dest = np.zeros(n + 3, dtype=np.uint8)[3:]
            ranges.append((off, dest))
        ranges.append((size - 1, bytearray(1)))
        io.read_ranges(path, ranges)
        for off, dest in ranges:
            assert bytes(dest) == data[off : off + len(dest)].tobytes(), off


def test_engines_write_identical_files(disk_dir, make_data):
    """libaio and threads put the same bytes on disk for the same data and write pattern."""
    ok, why = libaio_status()
    if not ok:
        pytest.skip(f"libaio engine unavailable: {why}")
    data = make_data(6 * MIB + 4099, seed=21)
    digests = {}
    for name in ("libaio", "threads"):
        with AioHandle(AioConfig(engine=name, block_size=512 * KIB, queue_depth=8)) as io:
            io.write_file(disk_dir / f"{name}.whole", data)
            with io.writer(disk_dir / f"{name}.stream") as w:
                for start in range(0, data.nbytes, 77_777):
                    w.write(data[start : start + 77_777])
        digests[name] = [hashlib.sha256(disk_bytes(disk_dir / f"{name}.{k}")).hexdigest() for k in ("whole", "stream")]
    expected = hashlib.sha256(data.tobytes()).hexdigest()
    assert digests["libaio"] == digests["threads"] == [expected, expected]


@pytest.mark.slow
def test_one_gib_plus_three(disk_dir):
    """1 GiB + 3 bytes through both engines (a few seconds; runs in CI). Buffers are reused."""
    engines = ["libaio", "threads"] if libaio_status()[0] else ["threads"]
    size = GIB + 3
    # A random period of a prime length: any block landing at a wrong 4 KiB-multiple offset differs.
    period = np.random.default_rng(1).integers(0, 256, 1_048_583, dtype=np.uint8)
    src = AlignedBuffer(size, pin=False)
    arr = src.numpy()
    for start in range(0, size, period.nbytes):
        n = min(period.nbytes, size - start)
        arr[start : start + n] = period[:n]
    out = AlignedBuffer(size, pin=False)
    paths = [disk_dir / f"big-{name}.bin" for name in engines]
    try:
        for name, path in zip(engines, paths):
            with AioHandle(AioConfig(engine=name)) as io:
                # as two parts: the first aligned part goes zero-copy, the odd tail is staged
                assert io.write_file(path, [src.view(GIB), src.view(3, GIB)]) == size
                assert os.path.getsize(path) == size
                out.numpy()[:] = 0
                assert io.read_file(path, out=out) is out
                assert np.array_equal(out.numpy(), arr), name
        # the same bytes on disk from both engines: each equals the source; spot-check with plain reads
        for path in paths:
            with open(path, "rb") as f:
                f.seek(size - 5 * MIB)
                assert f.read() == arr[size - 5 * MIB :].tobytes()
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
