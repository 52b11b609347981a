"""``aio.prefetch``: pulling files into the page cache, and buffered reads of the files it covers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aio import AioConfig, AioHandle
from aio import prefetch as pf


@pytest.fixture(autouse=True)
def _no_warm_files():
    pf.forget()
    yield
    pf.forget()


def _files(root: Path, sizes: list[int]) -> list[Path]:
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate(sizes):
        p = root / "sub" / f"f{i}.bin" if i % 2 else root / f"f{i}.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        out.append(p)
    return out


def test_prefetch_covers_files_under_directories_and_marks_them_warm(tmp_path: Path) -> None:
    files = _files(tmp_path, [5 << 20, 1 << 20, 12345])
    job = pf.prefetch_files([tmp_path], max_bytes=1 << 30)
    assert job.wait(60) and job.done
    assert sorted(job.files) == sorted(map(str, files)) and job.nbytes == sum(f.stat().st_size for f in files)
    assert job.skipped_bytes == 0
    assert all(pf.is_warm(f) for f in files)
    assert not pf.is_warm(tmp_path / "other.bin")
    pf.forget([files[0]])
    assert not pf.is_warm(files[0]) and pf.is_warm(files[1])


def test_memory_share_bounds_what_is_prefetched(tmp_path: Path) -> None:
    big, small = _files(tmp_path, [3 << 20, 1 << 20])
    job = pf.prefetch_files([big, small], max_bytes=2 << 20)
    job.wait(60)
    assert job.files == [str(small)] and job.skipped_bytes == 3 << 20
    assert not pf.is_warm(big) and pf.is_warm(small)
    empty = pf.prefetch_files([big], max_bytes=0)
    assert empty.done and empty.files == [] and empty.skipped_bytes == 3 << 20


def test_urls_and_missing_paths_are_ignored(tmp_path: Path) -> None:
    job = pf.prefetch_files(["memory://bucket/ckpt", tmp_path / "missing"], max_bytes=1 << 30)
    assert job.wait(5) and job.files == [] and job.nbytes == 0


def test_warm_files_are_read_buffered_with_the_same_bytes(disk_dir: Path) -> None:
    cold, warm = _files(disk_dir, [4 << 20, 4 << 20 | 1000])
    pf.prefetch_files([warm], max_bytes=1 << 30).wait(60)
    with AioHandle(AioConfig(engine="threads", block_size=1 << 20)) as io:
        assert io._read_direct(cold) is True
        assert io._read_direct(warm) is False
        for path in (cold, warm):
            data = path.read_bytes()
            assert bytes(io.read_file(path).view()) == data
            dest = bytearray(300_000)
            io.read_ranges(path, [(7, memoryview(dest)[:100_000]), (len(data) - 200_000, memoryview(dest)[100_000:])])
            assert bytes(dest) == data[7:100_007] + data[-200_000:]


def _io_class_of_a_thread(fn) -> int | None:
    """Run ``fn`` in a throwaway thread (I/O priority is per thread) and return its I/O class after."""
    import ctypes
    import platform
    import threading

    get = {"x86_64": 252, "aarch64": 31, "arm64": 31}.get(platform.machine())
    out: list[int | None] = []

    def run() -> None:
        fn()
        value = ctypes.CDLL(None, use_errno=True).syscall(get, 1, 0) if get is not None else -1
        out.append(None if value < 0 else value >> 13)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_io_priority_is_set_per_thread() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("ioprio is Linux-only")
    assert _io_class_of_a_thread(pf.lower_io_priority) == 3  # idle
    assert _io_class_of_a_thread(lambda: pf.set_io_priority(0)) in (0, 2)  # back to the default (best effort)


def test_no_descriptor_is_left_open_and_promote_is_harmless(tmp_path: Path) -> None:
    files = _files(tmp_path, [300_000] * 40)
    before = len(os.listdir("/proc/self/fd"))
    job = pf.prefetch_files(files, max_bytes=1 << 30)
    pf.promote()  # running jobs queue the rest at normal priority
    assert job.wait(60)
    job.promote()  # a finished job: nothing to do
    assert len(os.listdir("/proc/self/fd")) <= before
    assert len(job.files) == 40


def test_symlinked_files_count_once_and_vanished_ones_not_at_all(tmp_path: Path) -> None:
    real, other = _files(tmp_path, [1 << 20, 1 << 20])
    (tmp_path / "link.bin").symlink_to(real)
    (tmp_path / "dangling.bin").symlink_to(tmp_path / "gone.bin")
    names = sorted(os.path.basename(p) for p, _ in pf.regular_files([tmp_path]))
    assert len(names) == 2 and "dangling.bin" not in names  # the link and its target: one of them
    assert [p for p, _ in pf.regular_files([tmp_path / "link.bin"])] == [str(tmp_path / "link.bin")]


def test_importing_aio_prefetch_is_light() -> None:
    """The CLI imports it before torch; it must not pull numpy or the engines in."""
    probe = "import sys, aio.prefetch; print(sorted(m for m in ('numpy', 'torch', 'aio.handle') if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": "."},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
