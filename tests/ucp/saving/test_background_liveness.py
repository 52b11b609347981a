"""Liveness locks of asynchronous commits (ucp.saving.background.handshake): a dead rank is told from a slow one."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucp.saving.background import handshake as bg
from ucp.saving.background.job import WriteJob
from ucp.store.storage import LocalStorage


def _job(temp: str, rank: int) -> WriteJob:
    """A write job; the lock helpers read its ``temp`` and ``rank``."""
    return WriteJob(id=0, path="ck", name="ck", temp=temp, rank=rank)


def test_a_held_lock_is_alive_a_released_one_dead_a_missing_one_unknown(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    (tmp_path / "t").mkdir()
    assert bg.rank_dead(storage, _job("t", 0), 1) is False  # not started: keep waiting
    # rank 1 is another process that takes its lock, then dies
    code = (
        "import sys; from ucp.saving.background import handshake as bg; from ucp.store.storage import LocalStorage\n"
        "class J: temp, rank = 't', 1\n"
        f"fd = bg.hold_alive(LocalStorage({str(tmp_path)!r}), J()); assert fd is not None\n"
        "print('locked', flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "locked"
    assert bg.rank_dead(storage, _job("t", 0), 1) is False  # alive
    proc.kill()
    proc.wait()
    assert bg.rank_dead(storage, _job("t", 0), 1) is True  # its lock went with it
    assert sorted(os.listdir(tmp_path / "t")) == [bg.alive_name(1)]


def test_where_locks_do_not_work_nobody_is_declared_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = LocalStorage(str(tmp_path))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / bg.alive_name(1)).write_bytes(b"")

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert bg.rank_dead(storage, _job("t", 0), 1) is False  # falls back to commit_timeout
    assert bg.hold_alive(storage, _job("t", 2)) is None
    assert sorted(os.listdir(tmp_path / "t")) == [bg.alive_name(1)]  # no stray file of rank 2
