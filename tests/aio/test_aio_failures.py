"""Edge cases of the storage core (aio, and gds's CPU staged path).

Odd sizes and offsets, short reads, out of space, buffered fallback, descriptors, config
validation, prefetch robustness; and what must happen when things go wrong: failed submissions
give their staging blocks back, closed handles, engines and writers refuse I/O without touching
files, a writer that failed cannot report success, reads that raise leave nothing in flight,
bad arguments are refused up front naming the file and offset, AioError survives pickling.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import pickle
import threading
from concurrent.futures import Future

import numpy as np
import pytest
from pydantic import ValidationError

import aio.files
from aio import AioConfig, AioError, AioHandle, AlignedBuffer, ThreadEngine, create_engine, prefetch_files
from aio.engines.base import pread_full
from aio.prefetch import forget

KIB, MIB = 1 << 10, 1 << 20
BS = 8 * KIB  # small blocks so that a few KiB already span several requests


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _unaligned(n: int) -> np.ndarray:
    """A writable uint8 array of ``n`` bytes whose address is 3 past a page boundary."""
    return AlignedBuffer(n + 3, pin=False).numpy()[3:]


def _in_thread(fn, timeout: float) -> tuple[bool, object]:
    """Run ``fn`` in a daemon thread: (finished in time, its result or exception)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["v"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["v"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), box.get("v")


# --------------------------------------------------------------------------------------------
# Behaviour found right
# --------------------------------------------------------------------------------------------


SIZES = [0, 1, 4095, 4096, 4097, BS - 1, BS, BS + 1, 3 * BS + 5, 300_001]


def test_odd_sizes_and_offsets_are_bit_exact_and_engines_agree(disk_dir, make_data):
    engines = ["threads"] + (["libaio"] if create_engine(AioConfig(engine="auto")).name == "libaio" else [])
    files: dict[str, list[bytes]] = {}
    for engine in engines:
        with AioHandle(AioConfig(engine=engine, block_size=BS, queue_depth=4)) as io:
            files[engine] = []
            for n in SIZES:
                data = make_data(n, seed=n)
                path = disk_dir / f"{engine}-{n}.bin"
                assert io.write_file(path, data) == n
                raw = path.read_bytes()
                assert raw == data.tobytes(), (engine, n)
                files[engine].append(raw)
                assert io.read_file(path).numpy().tobytes() == data.tobytes()
                for off in (0, 1, 4095, 4096, 4097, BS - 1):
                    for length in (1, 4095, 4096, 4097, BS + 1):
                        if off + length > n:
                            continue
                        for dest in (np.zeros(length, np.uint8), _unaligned(length)):
                            assert io.read_into(path, off, dest) == length
                            assert dest.tobytes() == data[off : off + length].tobytes(), (engine, n, off, length)
    if len(files) == 2:
        assert files["threads"] == files["libaio"]


def test_non_power_of_two_block_size_round_trips(engine, disk_dir, make_data):
    data = make_data(5 * 12288 + 7, seed=3)
    with AioHandle(AioConfig(engine=engine, block_size=12288, queue_depth=2)) as io:
        io.write_file(disk_dir / "x.bin", data)
        assert io.read_file(disk_dir / "x.bin").numpy().tobytes() == data.tobytes()
        dest = _unaligned(20000)
        io.read_into(disk_dir / "x.bin", 12287, dest)
        assert dest.tobytes() == data[12287 : 12287 + 20000].tobytes()


def test_zero_length_writes_and_reads(engine, disk_dir):
    path = disk_dir / "empty.bin"
    with AioHandle(AioConfig(engine=engine, block_size=BS)) as io:
        assert io.write_file(path, b"") == 0
        assert path.stat().st_size == 0
        with io.writer(path, size_hint=0) as w:
            w.write(b"")
            w.write(np.zeros(0, np.uint8))
        assert w.size == 0 and path.stat().st_size == 0
        assert io.read_file(path).nbytes == 0
        assert io.read_into(path, 0, bytearray(0)) == 0
        io.read_ranges(path, [])


@pytest.mark.parametrize("size", [1, 4095, 4097, BS + 1])
def test_reads_past_the_end_raise_naming_file_and_offset(engine, disk_dir, make_data, size):
    data = make_data(size, seed=size)
    path = disk_dir / "short.bin"
    with AioHandle(AioConfig(engine=engine, block_size=BS)) as io:
        io.write_file(path, data)
        for off, n in [(0, size + 1), (size - 1, 2), (size, 1), (4096, 8192), (size + 4096, 10)]:
            for dest in (np.zeros(n, np.uint8), _unaligned(n), AlignedBuffer(n, pin=False).numpy()):
                with pytest.raises(AioError) as info:
                    io.read_into(path, off, dest)
                err = info.value
                assert err.errno == errno.ENODATA and err.filename == str(path)
                assert err.offset is not None and f"offset {err.offset}" in str(err) and str(path) in str(err)


def test_file_that_shrinks_under_a_read_is_an_error_not_zeros(engine, disk_dir, make_data, monkeypatch):
    """read_file sizes the file, then reads: if it shrank meanwhile the read must fail, not zero-fill."""
    data = make_data(5 * BS + 123, seed=9)
    path = disk_dir / "shrinks.bin"
    with AioHandle(AioConfig(engine=engine, block_size=BS)) as io:
        io.write_file(path, data)
        real = io.engine.submit_read
        shrunk: list[bool] = []

        def shrink_then_read(f, offset, buf, future=None):
            if not shrunk:
                os.truncate(path, 2 * BS + 5)
                shrunk.append(True)
            return real(f, offset, buf, future)

        monkeypatch.setattr(io.engine, "submit_read", shrink_then_read)
        with pytest.raises(AioError) as info:
            io.read_file(path)
        assert info.value.errno == errno.ENODATA and info.value.filename == str(path)
        assert info.value.offset is not None and info.value.offset >= 2 * BS


def test_destination_kinds(engine, disk_dir, make_data):
    data = make_data(40_000, seed=4)
    path = disk_dir / "dest.bin"
    with AioHandle(AioConfig(engine=engine, block_size=BS)) as io:
        io.write_file(path, data)
        for dtype in (np.float32, np.int16, np.float64, np.complex64):
            dest = np.zeros(4000 // np.dtype(dtype).itemsize, dtype)
            io.read_into(path, 1, dest)
            assert dest.view(np.uint8).tobytes() == data[1:4001].tobytes()
        # read-only destinations are refused and left untouched
        ro = np.zeros(8192, np.uint8)
        ro.flags.writeable = False
        aligned = AlignedBuffer(8192, pin=False)
        for dest in (ro, bytes(8192), memoryview(bytearray(8192)).toreadonly(), aligned.view().toreadonly()):
            with pytest.raises((TypeError, ValueError, BufferError)):
                io.read_into(path, 0, dest)
            assert bytes(dest) == bytes(8192)
        # non-contiguous numpy arrays are refused
        with pytest.raises(ValueError, match="contiguous"):
            io.read_into(path, 0, np.zeros(8192, np.uint8)[::2])
        with pytest.raises(ValueError, match="contiguous"):
            io.write_file(disk_dir / "nc.bin", np.zeros((64, 64), np.uint8).T)


def test_streaming_writer_many_tiny_writes_then_huge_ones(engine, disk_dir, make_data):
    tiny = [make_data(1, seed=i) for i in range(700)] + [make_data(k, seed=k) for k in (3, 4095, 7, 4097)]
    huge = make_data(3 * MIB + 11, seed=1)
    congruent = AlignedBuffer(MIB + 100, pin=False)
    congruent.numpy()[:] = make_data(congruent.nbytes, seed=2)
    expect = b"".join(t.tobytes() for t in tiny) + huge.tobytes() + b"z" + bytes(congruent.view(MIB, 0))
    path = disk_dir / "stream.bin"
    with AioHandle(AioConfig(engine=engine, block_size=256 * KIB, queue_depth=4)) as io:
        with io.writer(path, size_hint=1000) as w:  # a wrong (too small) hint too
            for t in tiny:
                w.write(t)
            w.write(huge)
            w.write(b"z")
            w.write(congruent.view(MIB, 0))
        assert w.size == len(expect)
        assert path.read_bytes() == expect
        assert io.read_file(path).numpy().tobytes() == expect


def test_abort_after_partial_writes_removes_the_file_and_returns_every_buffer(engine, disk_dir, make_data):
    path = disk_dir / "aborted.bin"
    with AioHandle(AioConfig(engine=engine, block_size=64 * KIB, queue_depth=2)) as io:
        before = _fds()
        for _ in range(io.pool.max_buffers + 2):
            w = io.writer(path, size_hint=MIB)
            w.write(make_data(300_001))
            w.write(b"tail")
            assert path.exists()
            w.abort()
            assert not path.exists()
            w.abort()  # idempotent
        with pytest.raises(RuntimeError):
            with io.writer(path) as w:
                w.write(make_data(200_000))
                raise RuntimeError("caller failed mid-file")
        assert not path.exists()
        assert _fds() == before
        held = [io.pool.acquire(timeout=2) for _ in range(io.pool.max_buffers)]
        for b in held:
            io.pool.release(b)


def test_no_descriptor_leaks_after_errors(engine, disk_dir, make_data):
    path = disk_dir / "f.bin"
    with AioHandle(AioConfig(engine=engine, block_size=BS, queue_depth=2)) as io:
        io.write_file(path, make_data(10_000))
        before = _fds()
        failing = [
            lambda: io.read_into(path, 9_000, bytearray(5_000)),  # past the end, staged
            lambda: io.read_into(path, 8192, AlignedBuffer(4096, pin=False).numpy()),  # past the end, direct
            lambda: io.read_ranges(path, [(0, bytearray(10)), (20_000, bytearray(10))]),
            lambda: io.read_into(path, 0, np.zeros(100, np.uint8)[::2]),  # bad destination
            lambda: io.read_into(disk_dir / "missing.bin", 0, bytearray(1)),
            lambda: io.read_file(disk_dir),  # a directory
            lambda: io.write_file(disk_dir, b"x"),
            lambda: io.write_file(disk_dir / "no" / "dir.bin", b"x"),
            lambda: io.write_file(disk_dir / "nc.bin", [b"ok", np.zeros((4, 4)).T]),
        ]
        for i, call in enumerate(failing):
            with pytest.raises((OSError, ValueError, TypeError, BufferError)):
                call()
            assert _fds() == before, f"case {i} leaked a descriptor"
        assert not (disk_dir / "nc.bin").exists()


def test_buffered_fallback_where_o_direct_is_refused_is_exact_and_fsynced(
    engine, no_direct_dir, make_data, monkeypatch
):
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(aio.files.os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    data = make_data(3 * MIB + 4097, seed=5)
    path = no_direct_dir / "buffered.bin"
    with AioHandle(AioConfig(engine=engine, block_size=256 * KIB)) as io:
        with io.writer(path, size_hint=data.nbytes) as w:
            assert not w.direct
            w.write(data[:7])
            w.write(data[7:])
        assert synced, "the buffered file was not fdatasync'ed"
        assert path.stat().st_size == data.nbytes and path.read_bytes() == data.tobytes()
        assert io.read_file(path).numpy().tobytes() == data.tobytes()
        dest = _unaligned(5000)
        io.read_into(path, 4095, dest)
        assert dest.tobytes() == data[4095:9095].tobytes()
        with pytest.raises(AioError) as info:
            io.read_into(path, data.nbytes - 3, bytearray(10))
        assert info.value.errno == errno.ENODATA and info.value.filename == str(path)


@pytest.mark.timeout(60)
def test_out_of_space_on_a_small_tmpfs(engine, tmp_path, mount_fs, make_data):
    """Many tiny writes then a huge one into an 8 MiB tmpfs: ENOSPC naming file and offset, file removed."""
    with mount_fs(tmp_path / "small", "tmpfs", "size=8m", "of 8 MiB to provoke ENOSPC") as mnt:
        path = mnt / "full.bin"
        huge = make_data(10 * MIB, seed=6)
        with AioHandle(AioConfig(engine=engine, block_size=MIB, queue_depth=2)) as io:
            before = _fds()
            for _ in range(io.pool.max_buffers + 1):
                with pytest.raises(AioError) as info:
                    with io.writer(path) as w:
                        for i in range(2000):
                            w.write(huge[i : i + 1])
                        w.write(huge)
                err = info.value
                assert err.errno == errno.ENOSPC and err.filename == str(path)
                assert err.offset is not None and f"offset {err.offset}" in str(err)
                assert not path.exists()
                assert _fds() == before
            small = make_data(MIB + 3, seed=7)
            io.write_file(mnt / "fits.bin", small)
            assert (mnt / "fits.bin").read_bytes() == small.tobytes()


@pytest.mark.parametrize(
    "field,bad",
    [
        ("block_size", 0),
        ("block_size", -4096),
        ("block_size", 4097),
        ("block_size", 1000),
        ("queue_depth", 0),
        ("queue_depth", -1),
        ("queue_depth", 10**6),
        ("thread_count", 0),
        ("thread_count", -2),
        ("alignment", 0),
        ("alignment", 3),
        ("alignment", 1000),
        ("engine", "io_uring"),
        ("block_size", "8M"),
        ("queue_depth", None),
    ],
)
def test_config_rejects_absurd_values_naming_the_field(field, bad):
    with pytest.raises(ValidationError) as info:
        AioConfig(**{field: bad})
    assert field in str(info.value)


def test_explicit_libaio_where_unavailable_fails_clearly(monkeypatch):
    import aio.engines.libaio_engine as le

    monkeypatch.setattr(le, "_pylibaio", None)
    monkeypatch.setattr(le, "LIBAIO_ERROR", "OSError: libaio.so.1: cannot open shared object file")
    with pytest.raises(RuntimeError, match="libaio is unavailable.*libaio.so.1"):
        AioHandle(AioConfig(engine="libaio"))
    with AioHandle(AioConfig(engine="auto")) as io:
        assert io.engine_name == "threads"


def test_read_ranges_with_duplicate_offsets_and_overlapping_file_ranges(engine, disk_dir, make_data):
    data = make_data(100_000, seed=8)
    path = disk_dir / "ranges.bin"
    out = np.zeros(40_000, np.uint8)
    with AioHandle(AioConfig(engine=engine, block_size=BS, queue_depth=2)) as io:
        io.write_file(path, data)
        ranges = [
            (10, out[0:5000]),
            (10, out[5000:10000]),
            (4096, out[10000:18192]),
            (4096, out[18192:26384]),
            (4000, out[26384:30000]),
            (99_999, out[30000:30001]),
        ]
        io.read_ranges(path, ranges)
        for off, dest in ranges:
            assert dest.tobytes() == data[off : off + dest.nbytes].tobytes()
        # the same destination twice, from the same offset: well defined (same bytes either way)
        same = _unaligned(7000)
        io.read_ranges(path, [(123, same), (123, same)])
        assert same.tobytes() == data[123:7123].tobytes()


def test_prefetch_never_fails_the_caller(tmp_path, disk_dir, make_data):
    (tmp_path / "loop").mkdir()
    os.symlink(tmp_path / "loop" / "b", tmp_path / "loop" / "a")
    os.symlink(tmp_path / "loop" / "a", tmp_path / "loop" / "b")
    os.symlink(tmp_path / "loop", tmp_path / "loop" / "self")
    os.symlink(tmp_path / "nowhere", tmp_path / "loop" / "dangling")
    os.mkfifo(tmp_path / "loop" / "fifo")
    (tmp_path / "empty").mkdir()
    real = tmp_path / "loop" / "real.bin"
    data = make_data(10_000)
    real.write_bytes(data.tobytes())
    paths = [
        tmp_path / "missing",
        tmp_path / "loop",
        tmp_path / "loop" / "a",
        tmp_path / "empty",
        tmp_path / "loop" / "fifo",
        "s3://bucket/key",
        "",
        tmp_path / "loop" / "self" / "self" / "real.bin",
    ]
    try:
        job = prefetch_files(paths)
        assert job.wait(10)
        assert [os.path.realpath(p) for p in job.files] == [os.path.realpath(real)]
        assert prefetch_files([tmp_path / "loop" / "a"]).files == []
        with AioHandle(AioConfig(block_size=BS)) as io:  # a warm file reads buffered, same bytes
            assert io.read_file(real).numpy().tobytes() == data.tobytes()
    finally:
        forget([real])


def test_one_handle_used_from_two_threads(engine, disk_dir, make_data):
    """Sharing one handle between threads is relied on (tests/aio/test_aio_concurrency.py): mix all calls."""
    errors: list[BaseException] = []
    with AioHandle(AioConfig(engine=engine, block_size=BS, queue_depth=2)) as io:

        def work(k: int) -> None:
            try:
                for i in range(6):
                    data = make_data(30_000 + 4097 * i + k, seed=10 * k + i)
                    path = disk_dir / f"t{k}-{i}.bin"
                    with io.writer(path) as w:
                        w.write(data[:5])
                        w.write(data[5:])
                    a, b = _unaligned(7000), np.zeros(9000, np.uint8)
                    io.read_ranges(path, [(3, a), (4096, b)])
                    assert a.tobytes() == data[3:7003].tobytes() and b.tobytes() == data[4096:13096].tobytes()
                    assert io.read_file(path).numpy().tobytes() == data.tobytes()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors


def test_gds_staged_cpu_path_odd_sizes_and_short_reads(engine, disk_dir):
    torch = pytest.importorskip("torch")
    from gds import GdsHandle

    path = disk_dir / "t.bin"
    with GdsHandle(AioConfig(engine=engine, block_size=64 * KIB), mode="staged", staging_bytes=12345) as g:
        for n in (0, 1, 4095, 4097, 16384, 3 * 16384 + 1):
            t = torch.randint(0, 256, (n,), dtype=torch.uint8)
            assert g.write_tensor(path, t) == n and path.stat().st_size == n
            assert torch.equal(g.read_tensor(path, torch.uint8, (n,)), t)
            if n > 7:
                assert torch.equal(g.read_tensor(path, torch.uint8, (n - 7,), offset=7), t[7:])
        t = torch.randn(1001, dtype=torch.bfloat16)
        g.write_tensor(path, t)
        assert torch.equal(g.read_tensor(path, torch.bfloat16, (1001,)).view(torch.int16), t.view(torch.int16))
        with pytest.raises(AioError) as info:
            g.read_tensor(path, torch.uint8, (2003,))
        assert info.value.filename == str(path) and info.value.errno == errno.ENODATA
        with pytest.raises(ValueError, match="offset"):
            g.read_tensor(path, torch.uint8, (3,), offset=-1)
    with pytest.raises(ValueError, match="closed"):
        g.write_tensor(path, t)


# --------------------------------------------------------------------------------------------
# Failures, closed objects and bad arguments
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_libaio_failed_submission_does_not_leak_staging_blocks(disk_dir, make_data):
    ok, _why = __import__("aio").libaio_status()
    if not ok:
        pytest.skip("libaio unavailable")
    path = disk_dir / "f.bin"
    io = AioHandle(AioConfig(engine="libaio", block_size=BS, queue_depth=1))
    try:
        io.write_file(path, make_data(20_000))
        # More requests than the pool has blocks, each refused by io_submit (EINVAL: the staged
        # aligned span would end past the largest file offset).
        for k in range(io.pool.max_buffers + 2):
            done, res = _in_thread(lambda k=k: io.read_into(path, (1 << 63) - 10 - k, bytearray(10)), 3)
            if not done:
                break
            assert isinstance(res, AioError) and res.errno == errno.EINVAL and res.filename == str(path)
        dest = bytearray(10)
        done, res = _in_thread(lambda: io.read_into(path, 3, dest), 3)
        assert done, "a valid read hangs: the failed submissions kept the staging blocks"
        assert bytes(dest) == make_data(20_000)[3:13].tobytes()
    finally:
        io.pool.reserve(100)  # unblock a hung reader so that it ends before the handle closes
        io.close()


@pytest.mark.timeout(60)
def test_closed_libaio_handle_refuses_io_and_leaves_other_handles_working(disk_dir, make_data):
    ok, _why = __import__("aio").libaio_status()
    if not ok:
        pytest.skip("libaio unavailable")
    path = disk_dir / "f.bin"
    data = make_data(20_000)
    cfg = AioConfig(engine="libaio", block_size=BS, queue_depth=2)
    h1 = AioHandle(cfg)
    h1.write_file(path, data)
    h1.close()
    h2 = AioHandle(cfg)
    try:
        done, res = _in_thread(lambda: h1.read_into(path, 0, bytearray(10)), 3)
        assert done, "I/O on a closed handle hangs"
        assert isinstance(res, (ValueError, OSError)) and "closed" in str(res)
        dest = bytearray(10)
        done, res = _in_thread(lambda: h2.read_into(path, 5, dest), 3)
        assert done and bytes(dest) == data[5:15].tobytes(), "the other handle was broken"
    finally:
        for req in list(h1.engine._inflight.values()):  # release a hung reader (test cleanup only)
            if not req.future.done():
                req.future.set_exception(RuntimeError("test cleanup"))
        h2.close()


def test_closed_handle_refuses_io_without_touching_files(engine, disk_dir, make_data):
    path = disk_dir / "precious.bin"
    path.write_bytes(b"previous checkpoint")
    io = AioHandle(AioConfig(engine=engine, block_size=BS))
    io.close()
    try:
        io.write_file(path, make_data(10_000))
    except Exception as exc:  # noqa: BLE001 - checked below, after the file
        err: Exception = exc
    else:
        pytest.fail("a closed handle wrote a file")
    assert path.exists() and path.read_bytes() == b"previous checkpoint", f"file destroyed; error was {err!r}"
    assert isinstance(err, (ValueError, OSError)) and "closed" in str(err), repr(err)


def test_writer_refuses_writes_after_close_or_abort(engine, disk_dir):
    path = disk_dir / "w.bin"
    with AioHandle(AioConfig(engine=engine, block_size=BS, queue_depth=1)) as io:
        w = io.writer(path)
        w.write(b"abc")
        assert w.close() == 3
        with pytest.raises((ValueError, OSError)):
            w.write(b"xyz")
        assert path.read_bytes() == b"abc" and w.size == 3
        w = io.writer(path)
        w.write(b"abc")
        w.abort()
        with pytest.raises((ValueError, OSError)):
            w.write(b"xyz")
        with io.writer(path) as w:  # an abort inside the with block stands: leaving it does not close
            w.write(b"abc")
            w.abort()
        assert not path.exists()


class _FailFirstWrite(ThreadEngine):
    """A thread engine whose first write fails with EIO (a bad sector), later ones succeed."""

    def __init__(self) -> None:
        super().__init__(2)
        self.writes = 0

    def submit_write(self, f, offset, buf, future=None):
        self.writes += 1
        if self.writes == 1:
            fut: Future = future or Future()
            fut.set_exception(AioError(errno.EIO, f.path, offset, "write"))
            return fut
        return super().submit_write(f, offset, buf, future)


def test_writer_that_failed_cannot_later_close_successfully(disk_dir):
    path = disk_dir / "w.bin"
    with AioHandle(AioConfig(block_size=256 * KIB, queue_depth=1), engine=_FailFirstWrite()) as io:
        a, b = AlignedBuffer(MIB, pin=False), AlignedBuffer(MIB, pin=False)
        a.numpy()[:] = 1
        b.numpy()[:] = 2
        w = io.writer(path, fsync=False)
        with pytest.raises(AioError):
            w.write(a.view())  # congruent memory: written zero-copy, the 2nd request surfaces the 1st's EIO
        try:
            w.write(b.view())
            w.close()
        except (OSError, ValueError):
            assert not path.exists()
        else:
            pytest.fail(
                f"close() succeeded after a failed write; the file holds {np.unique(np.fromfile(path, np.uint8))}"
            )


class _GatedReads(ThreadEngine):
    """Reads wait for ``gate``: a slow device, so requests are still in flight when the caller returns."""

    max_segments = 1  # every read through submit_read, which this engine hooks

    def __init__(self) -> None:
        super().__init__(2)
        self.gate = threading.Event()
        self.futures: list[Future] = []

    def submit_read(self, f, offset, buf, future=None):
        def gated(f, offset, buf) -> int:
            self.gate.wait(10)
            return pread_full(f, offset, buf)

        fut = self._start(gated, f, offset, buf, future or Future())
        self.futures.append(fut)
        return fut


def test_read_ranges_error_leaves_no_request_in_flight(disk_dir):
    path = disk_dir / "f.bin"
    engine = _GatedReads()
    with AioHandle(AioConfig(use_direct=False, block_size=BS), engine=engine) as io:
        io.write_file(path, np.full(8192, 0xAA, np.uint8))
        dest = np.zeros(4096, np.uint8)
        try:
            with pytest.raises(ValueError):
                io.read_ranges(path, [(0, dest), (0, np.zeros(8192, np.uint8)[::2])])
            still_running = sum(not f.done() for f in engine.futures)
        finally:
            engine.gate.set()
        assert still_running == 0, f"{still_running} read(s) still in flight after read_ranges raised"


def test_strided_memoryview_is_rejected_up_front(engine, disk_dir, make_data):
    src = bytearray(make_data(1 << 18).tobytes())
    path = disk_dir / "s.bin"
    with AioHandle(AioConfig(engine=engine, block_size=BS)) as io:
        io.write_file(path, src)
        for n in (200, 1 << 17, 1 << 18):
            view = memoryview(src)[:n:2]
            with pytest.raises(ValueError, match="contiguous"):
                io.write_file(disk_dir / "strided.bin", view)
            with pytest.raises(ValueError, match="contiguous") as info:
                io.read_into(path, 0, view)
            assert str(path) in str(info.value)
        assert not (disk_dir / "strided.bin").exists()
        assert path.read_bytes() == bytes(src)


def test_aio_error_survives_pickle_and_copy():
    err = AioError(errno.ENOSPC, "/ckpt/rank0.bin", 4096, "write")
    for back in (pickle.loads(pickle.dumps(err)), copy.copy(err), copy.deepcopy(err)):
        assert type(back) is AioError
        assert back.filename == "/ckpt/rank0.bin" and back.offset == 4096 and back.errno == errno.ENOSPC
        assert str(back) == str(err) and back.strerror == err.strerror
    bare = pickle.loads(pickle.dumps(AioError(errno.EIO, "/x.bin")))
    assert bare.offset is None and str(bare) == str(AioError(errno.EIO, "/x.bin"))


def test_config_bounds_block_size_at_one_gib():
    assert AioConfig(block_size=1 << 30).block_size == 1 << 30
    for bad in ((1 << 30) + 4096, 1 << 40):
        with pytest.raises(ValidationError, match="block_size"):
            AioConfig(block_size=bad)


def test_negative_offset_is_rejected_up_front(engine, disk_dir):
    path = disk_dir / "f.bin"
    with AioHandle(AioConfig(engine=engine, block_size=BS)) as io:
        io.write_file(path, b"x" * 10_000)
        for dest in (bytearray(10), _unaligned(10), AlignedBuffer(4096, pin=False).numpy()):
            with pytest.raises(ValueError, match="-1") as info:
                io.read_into(path, -1, dest)
            assert str(path) in str(info.value)
        with pytest.raises(ValueError, match=f"-4096.*{path.name}"):
            io.read_ranges(path, [(0, bytearray(10)), (-4096, bytearray(10))])
        with pytest.raises(TypeError):
            io.read_into(path, 1.5, bytearray(10))
        dest = bytearray(10)  # nothing leaked: the handle still reads
        io.read_into(path, 0, dest)
        assert bytes(dest) == b"x" * 10


def test_read_ranges_checks_every_destination_before_submitting_any(disk_dir):
    path = disk_dir / "f.bin"
    engine = _GatedReads()
    with AioHandle(AioConfig(use_direct=False, block_size=BS), engine=engine) as io:
        io.write_file(path, np.full(8192, 0xAA, np.uint8))
        engine.gate.set()
        ro = np.zeros(16, np.uint8)
        ro.flags.writeable = False
        for bad in (np.zeros(64, np.uint8)[::2], ro, bytes(16)):
            with pytest.raises(ValueError, match="f.bin") as info:
                io.read_ranges(path, [(0, np.zeros(4096, np.uint8)), (100, bad)])
            assert "offset 100" in str(info.value)
        assert engine.futures == [], "a read was submitted before a later range was refused"


class _FailSecondRead(ThreadEngine):
    """A thread engine whose second read submission raises (io_submit refusing it); the first is slow."""

    def __init__(self) -> None:
        super().__init__(2)
        self.futures: list[Future] = []

    def submit_read(self, f, offset, buf, future=None):
        if self.futures:
            raise AioError(errno.EINVAL, f.path, offset, "io_submit")
        slow = lambda f, offset, buf: (threading.Event().wait(0.3), pread_full(f, offset, buf))[1]  # noqa: E731
        self.futures.append(self._start(slow, f, offset, buf, future or Future()))
        return self.futures[0]


def test_read_that_fails_to_submit_waits_for_what_is_in_flight(disk_dir):
    path = disk_dir / "f.bin"
    with AioHandle(AioConfig(use_direct=False, block_size=BS), engine=_FailSecondRead()) as io:
        io.write_file(path, np.full(4 * BS, 7, np.uint8))
        dest = np.zeros(2 * BS, np.uint8)  # two blocks: two requests
        with pytest.raises(AioError, match="io_submit"):
            io.read_into(path, 0, dest)
        assert all(f.done() for f in io.engine.futures), "a read still writes into dest after read_into raised"
        free_before = len(io.pool._free) + (io.pool.max_buffers - io.pool.created)
        assert free_before == io.pool.max_buffers, "a staging block was kept"


def test_closed_engines_refuse_requests_naming_the_file(engine, disk_dir):
    path = disk_dir / "f.bin"
    path.write_bytes(b"x" * 8192)
    eng = create_engine(AioConfig(engine=engine, queue_depth=2))
    eng.close()
    with aio.files.open_file(path, "r", direct=False) as f:
        for submit in (eng.submit_read, eng.submit_write):
            with pytest.raises(ValueError, match=f"closed.*{path.name}.*offset 4096"):
                submit(f, 4096, memoryview(bytearray(4096)))
    eng.close()  # idempotent


@pytest.mark.timeout(60)
def test_libaio_reaper_skips_completions_it_does_not_know(disk_dir, caplog):
    """A completion for an iocb the engine never registered (one submitted into a reused context id)."""
    ok, _why = __import__("aio").libaio_status()
    if not ok:
        pytest.skip("libaio unavailable")
    import ctypes

    import libaio
    from libaio import libaio as raw

    path = disk_dir / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    eng = create_engine(AioConfig(engine="libaio", queue_depth=2))
    try:
        with (
            caplog.at_level(logging.WARNING, logger="aio.engines.libaio_engine"),
            aio.files.open_file(path, "r", direct=False) as f,
        ):
            stray = bytearray(4096)
            block = libaio.AIOBlock(libaio.AIOBLOCK_MODE_READ, target_file=f.fd, buffer_list=[stray], offset=0)
            raw.io_submit(eng._ctx, 1, (raw.iocb_p * 1)(ctypes.pointer(block._iocb)))
            buf = bytearray(4096)
            assert eng.submit_read(f, 4096, memoryview(buf)).result(timeout=10) == 4096
            assert bytes(buf) == bytes(range(256)) * 16
            for _ in range(100):  # the stray completion may be reaped after ours
                if "unknown request" in caplog.text:
                    break
                threading.Event().wait(0.05)
            assert "unknown request" in caplog.text
            assert eng.submit_read(f, 0, memoryview(buf)).result(timeout=10) == 4096
    finally:
        eng.close()


@pytest.mark.timeout(60)
def test_libaio_reaper_that_crashes_fails_pending_requests(disk_dir, monkeypatch):
    ok, _why = __import__("aio").libaio_status()
    if not ok:
        pytest.skip("libaio unavailable")
    path = disk_dir / "f.bin"
    path.write_bytes(b"x" * 8192)
    eng = create_engine(AioConfig(engine="libaio", queue_depth=2))
    try:

        def crash(req, res):
            raise RuntimeError("reaper bug")

        monkeypatch.setattr(eng, "_complete", crash)
        with aio.files.open_file(path, "r", direct=False) as f:
            fut = eng.submit_read(f, 0, memoryview(bytearray(4096)))
            with pytest.raises(RuntimeError, match="reaper bug"):
                fut.result(timeout=10)
            with pytest.raises(AioError, match="failed earlier") as info:
                eng.submit_read(f, 4096, memoryview(bytearray(4096)))
            assert info.value.filename == str(path)
    finally:
        eng.close()  # returns: the reaper ended


def test_writer_refuses_close_after_abort_and_a_failed_close(engine, disk_dir):
    path = disk_dir / "w.bin"
    with AioHandle(AioConfig(engine=engine, block_size=BS)) as io:
        w = io.writer(path)
        w.write(b"abc")
        w.abort()
        with pytest.raises(ValueError, match="w.bin.*aborted"):
            w.close()
        w = io.writer(path)
        w.write(b"abc")
        assert w.close() == 3 and w.close() == 3  # closing twice is fine
        w.abort()  # a no-op once closed: the file stays
        assert path.read_bytes() == b"abc"


def test_writer_refusing_a_bad_buffer_stays_usable(engine, disk_dir, make_data):
    path = disk_dir / "w.bin"
    data = make_data(20_000)
    with AioHandle(AioConfig(engine=engine, block_size=BS)) as io:
        with io.writer(path) as w:
            w.write(data[:5000])
            with pytest.raises(ValueError, match="contiguous"):
                w.write(np.zeros((64, 64), np.uint8).T)
            w.write(data[5000:])
        assert path.read_bytes() == data.tobytes()


def test_writer_failure_names_the_error_in_later_calls(disk_dir):
    path = disk_dir / "w.bin"
    with AioHandle(AioConfig(block_size=BS, queue_depth=1), engine=_FailFirstWrite()) as io:
        w = io.writer(path, fsync=False)
        w.write(b"x" * 100)
        with pytest.raises(AioError):
            w.close()  # the tail's write fails
        assert not path.exists()
        with pytest.raises(ValueError, match="w.bin.*aborted after an error.*Input/output error"):
            w.write(b"y")
        held = [io.pool.acquire(timeout=2) for _ in range(io.pool.max_buffers)]  # every block back
        for b in held:
            io.pool.release(b)


def test_shared_handle_replaces_a_closed_one():
    from aio import shared_handle

    cfg = AioConfig(engine="threads", block_size=BS, queue_depth=3)
    h = shared_handle(cfg)
    h.close()
    again = shared_handle(cfg)
    assert again is not h and not again.closed and h.closed
    again.close()


def test_prefetch_takes_one_bare_path_as_one_path(tmp_path, make_data):
    (tmp_path / "d").mkdir()
    f = tmp_path / "d" / "a.bin"
    f.write_bytes(make_data(5000).tobytes())
    try:
        for arg in (str(tmp_path / "d"), tmp_path / "d", os.fsencode(tmp_path / "d")):
            job = prefetch_files(arg)
            assert job.wait(10)
            assert [os.path.realpath(os.fsdecode(p)) for p in job.files] == [os.path.realpath(f)]
        assert aio.prefetch.is_warm(f) and aio.prefetch.is_warm(os.fsencode(f))
        forget(str(f))  # one bare path here too
        assert not aio.prefetch.is_warm(f)
    finally:
        forget([f])


class _InterruptedAfterTaking(ThreadEngine):
    """A thread engine whose first read is taken (queued, held by ``gate``) and then interrupted: the
    KeyboardInterrupt of a Ctrl-C landing just after the engine took the request, before submit returned."""

    max_segments = 1  # every read through submit_read, which this engine hooks

    def __init__(self) -> None:
        super().__init__(2)
        self.gate = threading.Event()
        self.taken: list[Future] = []

    def submit_read(self, f, offset, buf, future=None):
        def gated(f, offset, buf) -> int:
            self.gate.wait(10)
            return pread_full(f, offset, buf)

        fut = self._start(gated, f, offset, buf, future or Future())
        if not self.taken:
            self.taken.append(fut)
            threading.Timer(0.3, self.gate.set).start()
            raise KeyboardInterrupt
        self.gate.wait(10)
        return fut


def test_interrupt_after_the_engine_took_a_staged_read_keeps_its_block_until_it_completes(disk_dir, make_data):
    """The staging block of a read the engine already took must not go back to the pool (or the call return)
    before that read completes: a later read could get the block while the device still writes into it."""
    data = make_data(4 * BS, seed=11)
    path = disk_dir / "f.bin"
    engine = _InterruptedAfterTaking()
    with AioHandle(AioConfig(block_size=BS, queue_depth=4), engine=engine) as io:
        io.write_file(path, data)
        dest = np.zeros(BS // 2, np.uint8)
        with pytest.raises(KeyboardInterrupt):
            io.read_into(path, 1, dest)  # unaligned: one staged read
        assert engine.taken[0].done(), "read_into raised while its read was still in flight"
        assert dest.tobytes() == data[1 : 1 + BS // 2].tobytes()  # it landed before the call gave up
        again = np.zeros(BS // 2, np.uint8)
        io.read_into(path, 3, again)
        assert again.tobytes() == data[3 : 3 + BS // 2].tobytes()
        assert len(io.pool._free) == io.pool._created  # every block back, none twice
