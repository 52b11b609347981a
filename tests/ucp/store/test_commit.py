"""The atomic commit: a checkpoint path always holds a complete checkpoint (old or new), never a partial one."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from repo_paths import REPO
from ucp_helpers import assert_same_state

import ucp
from aio import AioError, FileWriter
from ucp.dist import Group
from ucp.saving.sync_save import save_with
from ucp.store.storage import LocalStorage, open_storage

OLD = {"w": torch.arange(12.0).reshape(3, 4), "step": 1}
NEW = {"w": torch.ones(5, 5), "x": torch.zeros(3, dtype=torch.int8), "step": 2}


def save_hooked(path: Path, state: dict, hook) -> ucp.Manifest:
    storage, name = open_storage(path)
    with storage:
        return save_with(storage, name, state, Group(0, 1), step=None, metadata={}, mesh=None, before_swap=hook)


def siblings(path: Path) -> list[str]:
    return sorted(os.listdir(path.parent))


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_overwrite_keeps_old_loadable_until_the_rename(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(LocalStorage, "exchange", lambda self, a, b: False)
    path = tmp_path / "ck"
    ucp.save(OLD, path)
    seen = {}

    def hook():
        seen["during"] = ucp.load(path)  # new data and manifest are durable, old still in place
        seen["siblings"] = siblings(path)

    save_hooked(path, NEW, hook)
    assert_same_state(seen["during"], OLD)
    assert any(s.startswith(".ck.tmp-") for s in seen["siblings"])
    assert_same_state(ucp.load(path), NEW)
    assert siblings(path) == ["ck"]  # no temp, no old directory left


def test_fallback_window_leaves_both_complete(tmp_path, monkeypatch):
    """Between the two renames of the fallback the old and new checkpoints both exist, complete."""
    monkeypatch.setattr(LocalStorage, "exchange", lambda self, a, b: False)
    path = tmp_path / "ck"
    ucp.save(OLD, path)
    orig = LocalStorage.rename
    seen = []

    def spy(self, src, dst):
        orig(self, src, dst)
        if dst.startswith(".ck.old-"):
            seen.append(sorted(os.listdir(tmp_path)))
            assert_same_state(ucp.load(tmp_path / dst), OLD)
            tmp = next(s for s in os.listdir(tmp_path) if s.startswith(".ck.tmp-"))
            assert_same_state(ucp.load(tmp_path / tmp), NEW)
            with pytest.raises(ucp.NotACheckpointError):
                ucp.load(path)

    monkeypatch.setattr(LocalStorage, "rename", spy)
    ucp.save(NEW, path)
    assert seen and "ck" not in seen[0]
    assert_same_state(ucp.load(path), NEW)


@pytest.mark.parametrize("fail_at", ["write", "close", "commit"])
def test_failed_save_leaves_previous_checkpoint_and_no_temp(tmp_path, monkeypatch, fail_at):
    path = tmp_path / "ck"
    ucp.save(OLD, path)
    before = (path / "manifest.json").read_bytes()
    if fail_at == "write":
        calls = {"n": 0}
        orig_write = FileWriter.write

        def failing_write(self, data):
            calls["n"] += 1
            if calls["n"] == 2:  # after the header, in the middle of the data
                raise AioError(errno.ENOSPC, self.path, 4096, "simulated")
            return orig_write(self, data)

        monkeypatch.setattr(FileWriter, "write", failing_write)
        expected = AioError
    elif fail_at == "close":

        def failing_close(self):
            self.abort()
            raise AioError(errno.EIO, self.path, None, "fsync (simulated)")

        monkeypatch.setattr(FileWriter, "close", failing_close)
        expected = AioError
    else:

        def failing_rename(self, src, dst):
            raise OSError(errno.EXDEV, "simulated rename failure")

        monkeypatch.setattr(LocalStorage, "rename", failing_rename)
        monkeypatch.setattr(LocalStorage, "exchange", lambda self, a, b: False)
        expected = OSError
    with pytest.raises(expected):
        ucp.save(NEW, path)
    assert siblings(path) == ["ck"]
    assert (path / "manifest.json").read_bytes() == before
    assert_same_state(ucp.load(path), OLD)


def test_refuses_to_replace_a_non_checkpoint(tmp_path):
    target = tmp_path / "data"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(ucp.CheckpointError, match="not a checkpoint.*refusing"):
        ucp.save(NEW, target)
    assert (target / "precious.txt").read_text() == "keep me"
    assert siblings(target) == ["data"]
    empty = tmp_path / "empty"
    empty.mkdir()
    ucp.save(NEW, empty)  # an empty directory may be replaced
    assert_same_state(ucp.load(empty), NEW)


def test_leftover_temp_dirs_are_never_loaded(tmp_path):
    path = tmp_path / "ck"
    ucp.save(NEW, tmp_path / ".ck.tmp-deadbeef")  # a complete-looking leftover
    with pytest.raises(ucp.NotACheckpointError):
        ucp.load(path)


def test_crash_before_rename_keeps_old_checkpoint(tmp_path):
    """A process killed after writing everything but before the rename: old checkpoint intact."""
    path = tmp_path / "ck"
    ucp.save(OLD, path)
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from ucp.dist import Group
        from ucp.saving.sync_save import save_with
        from ucp.store.storage import open_storage
        storage, name = open_storage({str(path)!r})
        save_with(storage, name, {{"w": torch.ones(5, 5)}}, Group(0, 1), step=None, metadata={{}}, mesh=None,
                  before_swap=lambda: os._exit(3))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert_same_state(ucp.load(path), OLD)
    leftovers = [s for s in siblings(path) if s != "ck"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".ck.tmp-")
    ucp.save(NEW, path)  # a later save is not disturbed by the leftover
    assert_same_state(ucp.load(path), NEW)
