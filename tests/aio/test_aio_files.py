"""O_DIRECT and its tmpfs fallback, preallocation, and the errors: out of space, short reads, missing files."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from aio import AioConfig, AioError, AioHandle, AlignedBuffer, fsync_dir, open_file

KIB, MIB = 1 << 10, 1 << 20


def fd_flags(fd: int) -> int:
    """The open flags the kernel holds for ``fd`` (from /proc, not from our own bookkeeping)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    raise AssertionError("no flags line in fdinfo")


def test_files_on_ext4_are_opened_with_o_direct(engine, disk_dir):
    path = disk_dir / "d.bin"
    with open_file(path, "w") as f:
        assert f.direct and f.writable
        assert fd_flags(f.fd) & os.O_DIRECT
    with open_file(path, "r") as f:
        assert f.direct and not f.writable
        assert fd_flags(f.fd) & os.O_DIRECT
    with AioHandle(AioConfig(engine=engine)) as io:
        with io.writer(path) as w:
            assert w.direct
            w.write(b"x" * 5000)
        assert path.read_bytes() == b"x" * 5000
    with open_file(path, "r", direct=False) as f:
        assert not f.direct and not fd_flags(f.fd) & os.O_DIRECT
    with AioHandle(AioConfig(engine=engine, use_direct=False)) as io:
        with io.writer(disk_dir / "buffered.bin") as w:
            assert not w.direct


def _round_trips(io: AioHandle, directory: Path, data: np.ndarray) -> None:
    """Streaming writes, whole files of awkward sizes and an unaligned read_into, all bit-exact."""
    with io.writer(directory / "a.bin", size_hint=data.nbytes) as w:
        for start in range(0, data.nbytes, 10_001):
            w.write(data[start : start + 10_001])
    assert (directory / "a.bin").read_bytes() == data.tobytes()
    for size in (0, 1, 4095, 4096, 4097, 1 * MIB + 3):
        io.write_file(directory / f"w{size}.bin", data[:size])
        assert os.path.getsize(directory / f"w{size}.bin") == size
        assert np.array_equal(io.read_file(directory / f"w{size}.bin").numpy(), data[:size])
    dest = np.zeros(70_001, dtype=np.uint8)[1:]
    io.read_into(directory / "a.bin", 12_345, dest)
    assert np.array_equal(dest, data[12_345 : 12_345 + 70_000])


def test_falls_back_to_buffered_io_where_o_direct_is_refused(engine, no_direct_dir, make_data, caplog):
    caplog.set_level(logging.INFO, logger="aio.files")
    data = make_data(2 * MIB + 4097, seed=4)
    with AioHandle(AioConfig(engine=engine, block_size=256 * KIB, queue_depth=4)) as io:
        with io.writer(no_direct_dir / "first.bin") as w:
            assert not w.direct
            w.write(b"abc")
        with open_file(no_direct_dir / "first.bin", "r") as f:
            assert not f.direct and not fd_flags(f.fd) & os.O_DIRECT
        _round_trips(io, no_direct_dir, data)
    refused = [r.getMessage() for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert len(refused) == 1, refused  # logged once per directory, not once per file
    assert str(no_direct_dir) in refused[0]


def test_tmpfs_round_trips(engine, shm_dir, make_data, caplog):
    """On /dev/shm the kernel decides (tmpfs takes O_DIRECT since Linux 6.6); either way bytes are exact."""
    caplog.set_level(logging.INFO, logger="aio.files")
    probe = shm_dir / "probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644))
        kernel_takes_direct = True
    except OSError:
        kernel_takes_direct = False
    probe.unlink(missing_ok=True)
    with AioHandle(AioConfig(engine=engine, block_size=256 * KIB, queue_depth=4)) as io:
        with io.writer(shm_dir / "first.bin") as w:
            assert w.direct == kernel_takes_direct
        _round_trips(io, shm_dir, make_data(2 * MIB + 4097, seed=6))
    refused = any("O_DIRECT refused" in r.getMessage() and str(shm_dir) in r.getMessage() for r in caplog.records)
    assert refused == (not kernel_takes_direct)


@pytest.mark.parametrize("hint", [lambda n: n, lambda n: 2 * n + 12_345, lambda n: n // 2])
def test_size_hint_preallocates_and_padding_is_trimmed(engine, disk_dir, make_data, hint):
    data = make_data(3 * MIB + 3, seed=8)
    path = disk_dir / "p.bin"
    size_hint = hint(data.nbytes)
    with AioHandle(AioConfig(engine=engine, block_size=1 * MIB)) as io:
        with io.writer(path, size_hint=size_hint) as w:
            # preallocated up front: the file already spans the hint, rounded up to the alignment
            assert os.path.getsize(path) == -(-size_hint // 4096) * 4096
            w.write(data)
        assert os.path.getsize(path) == data.nbytes
        assert path.read_bytes() == data.tobytes()
        # write_file preallocates too, and leaves exactly the data
        io.write_file(path, data[:4097])
        assert path.read_bytes() == data[:4097].tobytes()


@pytest.mark.timeout(120)  # a leaked staging buffer shows up as a hang, not an error
@pytest.mark.parametrize("how", ["writer", "writer+size_hint", "write_file"])
def test_out_of_space_raises_naming_the_file_and_removes_it(engine, tiny_fs, how):
    """8 MiB into a 4 MiB file system: fallocate fails up front with a size hint, the writes fail late without."""
    path = tiny_fs / f"{how}.bin"
    chunk = np.full(100_000, 7, dtype=np.uint8)
    total = 8 * MIB
    cfg = AioConfig(engine=engine, block_size=256 * KIB, queue_depth=2)
    with AioHandle(cfg) as io:
        for _attempt in range(cfg.queue_depth + 4):  # more failures than the pool has buffers
            with pytest.raises(AioError) as info:
                if how == "write_file":
                    io.write_file(path, np.zeros(total, dtype=np.uint8))
                else:
                    with io.writer(path, size_hint=total if how == "writer+size_hint" else None) as w:
                        for _ in range(0, total, chunk.nbytes):
                            w.write(chunk)
            err = info.value
            assert isinstance(err, OSError) and err.errno == errno.ENOSPC
            assert err.filename == str(path) and str(path) in str(err)
            assert "offset" in str(err)
            if how != "writer":
                assert "preallocating" in str(err)  # failed early, at fallocate
            assert not path.exists(), "the partial file must be removed"
        assert os.listdir(tiny_fs) == []
        # the failures handed every staging buffer back: the handle still works
        held = [io.pool.acquire(timeout=2) for _ in range(io.pool.max_buffers)]
        for b in held:
            io.pool.release(b)
        io.write_file(tiny_fs / "fits.bin", b"ok" * 1000)
        assert (tiny_fs / "fits.bin").read_bytes() == b"ok" * 1000


def test_short_read_names_file_and_offset(engine, disk_dir, make_data):
    data = make_data(10_000, seed=2)
    path = disk_dir / "short.bin"
    with AioHandle(AioConfig(engine=engine)) as io:
        io.write_file(path, data)
        cases = [
            (8192, AlignedBuffer(4096, pin=False).numpy()),  # aligned: direct read comes back short
            (9000, bytearray(2000)),  # unaligned: staged read comes back short
            (1, np.zeros(10_000, dtype=np.uint8)),  # one byte too many
            (20_000, bytearray(10)),  # wholly past the end
        ]
        for offset, dest in cases:
            with pytest.raises(AioError) as info:
                io.read_into(path, offset, dest)
            err = info.value
            end = offset + len(dest)
            assert err.filename == str(path) and str(path) in str(err)
            assert err.errno == errno.ENODATA and err.offset is not None
            assert f"at offset {err.offset}" in str(err) and f"file ends before {end}" in str(err)
        with pytest.raises(AioError) as info:
            io.read_ranges(path, [(0, bytearray(100)), (9999, bytearray(2))])
        assert info.value.filename == str(path)


def test_missing_file_raises_aio_error(engine, disk_dir):
    with AioHandle(AioConfig(engine=engine)) as io:
        for call in (lambda p: io.read_file(p), lambda p: io.read_into(p, 0, bytearray(1))):
            with pytest.raises(AioError) as info:
                call(disk_dir / "nope.bin")
            assert info.value.errno == errno.ENOENT and info.value.filename == str(disk_dir / "nope.bin")
        with pytest.raises(AioError) as info:
            io.write_file(disk_dir / "no-such-dir" / "x.bin", b"x")
        assert info.value.errno == errno.ENOENT


def test_exception_inside_writer_removes_partial_file(engine, disk_dir):
    path = disk_dir / "partial.bin"
    with AioHandle(AioConfig(engine=engine, block_size=64 * KIB)) as io:
        with pytest.raises(RuntimeError, match="boom"):
            with io.writer(path, size_hint=1 * MIB) as w:
                w.write(bytes(300 * KIB))
                raise RuntimeError("boom")
        assert not path.exists()


def test_fsync_dir(disk_dir):
    (disk_dir / "f").write_bytes(b"1")
    fsync_dir(disk_dir)  # must not raise on a real directory
    with pytest.raises(OSError):
        fsync_dir(disk_dir / "missing")
