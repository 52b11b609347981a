"""Project-wide test switches.

Tests marked ``full_matrix`` (the whole cross-product of layouts or peer configurations) run only
with ``UCP_FULL_MATRIX=1``; CI runs the covering subset that the other tests form.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("UCP_FULL_MATRIX") == "1":
        return
    skip = pytest.mark.skip(reason="full matrix: set UCP_FULL_MATRIX=1 to run it")
    for item in items:
        if "full_matrix" in item.keywords:
            item.add_marker(skip)


@contextmanager
def mounted(mnt: Path, fstype: str, options: str | None, why: str) -> Iterator[Path]:
    """Mount a fresh ``fstype`` at ``mnt`` for one test (needs root); skip, saying why, when we cannot."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {fstype} {why} needs root")
    mnt.mkdir()
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} {why}: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def mount_fs() -> Callable[[Path, str, str | None, str], ContextManager[Path]]:
    """``mount_fs(mnt, fstype, options, why)``: a small file system mounted for one test (tiny tmpfs for
    ENOSPC, ramfs that refuses O_DIRECT), unmounted afterwards."""
    return mounted
