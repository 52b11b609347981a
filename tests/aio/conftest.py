"""Fixtures for the aio tests: real directories on a disk that takes O_DIRECT, on tmpfs, on a file
system that refuses O_DIRECT, and on a deliberately tiny tmpfs for out-of-space errors."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from aio import libaio_status

REPO = Path(__file__).resolve().parents[2]
ENGINES = ["libaio", "threads"]


def _takes_o_direct(directory: Path) -> bool:
    probe = directory / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory on a file system that accepts O_DIRECT (pytest's tmp_path, else one in the repo)."""
    if _takes_o_direct(tmp_path):
        yield tmp_path
        for child in tmp_path.iterdir():  # pytest keeps the last runs' tmp dirs; don't keep our GiBs
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        return
    base = REPO / ".pytest-tmp"
    base.mkdir(exist_ok=True)
    d = Path(tempfile.mkdtemp(dir=base))
    try:
        if not _takes_o_direct(d):
            pytest.skip(f"neither {tmp_path} nor {base} accepts O_DIRECT")
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on tmpfs (/dev/shm): O_DIRECT is refused there before Linux 6.6, taken since."""
    if not os.path.isdir("/dev/shm") or _fs_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ucp-aio-test-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tiny_fs(tmp_path: Path, mount_fs) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test, unmounted afterwards."""
    with mount_fs(tmp_path / "tiny", "tmpfs", "size=4m", "of 4 MiB to provoke ENOSPC") as mnt:
        yield mnt


@pytest.fixture
def no_direct_dir(tmp_path: Path, mount_fs) -> Iterator[Path]:
    """A directory whose file system refuses O_DIRECT: /dev/shm on kernels before 6.6, else a ramfs mount."""
    if os.path.isdir("/dev/shm") and _fs_type("/dev/shm") == "tmpfs":
        d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ucp-aio-test-"))
        try:
            if not _takes_o_direct(d):
                yield d
                return
        finally:
            shutil.rmtree(d, ignore_errors=True)
    with mount_fs(tmp_path / "ramfs", "ramfs", None, "(tmpfs takes O_DIRECT since Linux 6.6)") as mnt:
        if _takes_o_direct(mnt):
            pytest.skip("even ramfs accepts O_DIRECT here; no file system to test the fallback on")
        yield mnt


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """Each test using this runs once per engine; libaio is skipped where the kernel/library lacks it."""
    if request.param == "libaio":
        ok, why = libaio_status()
        if not ok:
            pytest.skip(f"libaio engine unavailable: {why}")
    return request.param


@pytest.fixture
def make_data() -> Callable[..., np.ndarray]:
    """``make_data(n, seed)``: ``n`` random bytes (numpy uint8), different for each seed."""

    def make(n: int, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)

    return make


def _fs_type(path: str) -> str:
    best, fstype = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mnt, typ, *_ = line.split()
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, typ
    return fstype
