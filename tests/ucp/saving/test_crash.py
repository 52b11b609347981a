"""Crash safety: saving processes SIGKILLed at random moments; saves that run out of space.

The kill trials live in tools/crash_harness.py (``python tools/crash_harness.py --trials 200``
runs more); CI runs a few dozen small ones.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from repo_paths import REPO

import ucp
from ucp.manager import CheckpointManager, list_checkpoints
from ucp.saving.async_save import AsyncSaver

sys.path.insert(0, str(REPO / "tools"))

import crash_harness  # noqa: E402

SEED = int(os.environ.get("UCP_CRASH_SEED", "0"))


def _assert_ok(report: dict) -> None:
    failures = {m: s["failures"] for m, s in report["modes"].items() if s["failures"]}
    assert report["ok"], f"crash trials failed (UCP_CRASH_SEED={SEED}): {failures}"


@pytest.mark.timeout(300)
def test_killed_synchronous_saves_leave_a_loadable_checkpoint(tmp_path):
    report = crash_harness.run_trials(20, ["manager", "plain"], mib=16, seed=SEED, root=str(tmp_path))
    _assert_ok(report)
    assert sum(s["trials"] for s in report["modes"].values()) == 20


@pytest.mark.timeout(300)
def test_killed_trainers_with_a_writer_process_lose_no_returned_save(tmp_path):
    report = crash_harness.run_trials(3, ["async"], mib=16, seed=SEED, root=str(tmp_path))
    _assert_ok(report)


# -- out of space ---------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path, mount_fs) -> Iterator[Path]:
    """An 8 MiB tmpfs for this test."""
    with mount_fs(tmp_path / "small", "tmpfs", "size=8m", "of 8 MiB to provoke ENOSPC") as mnt:
        yield mnt


def small_state(fill: float) -> dict:
    return {"w": torch.full((1 << 18,), fill), "step": int(fill)}  # 1 MiB


def big_state() -> dict:
    return {"w": torch.ones(3 << 20)}  # 12 MiB: cannot fit


def _check_no_space(exc: BaseException, where: Path) -> None:
    assert isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT), repr(exc)
    assert exc.filename and str(where) in exc.filename and exc.filename.endswith(".safetensors"), exc.filename
    assert "No space left" in str(exc)


def _check_intact(path: Path, fill: float) -> None:
    back = ucp.load(path)
    assert torch.equal(back["w"], torch.full((1 << 18,), fill)) and back["step"] == int(fill)
    assert ucp.verify(path).ok


def test_no_space_in_a_plain_save(small_fs):
    ucp.save(small_state(1.0), small_fs / "ck")
    with pytest.raises(OSError) as info:
        ucp.save(big_state(), small_fs / "ck")
    _check_no_space(info.value, small_fs)
    _check_intact(small_fs / "ck", 1.0)
    assert sorted(os.listdir(small_fs)) == ["ck"]  # temporary directory removed
    ucp.save(small_state(2.0), small_fs / "ck")  # the space came back
    _check_intact(small_fs / "ck", 2.0)


def test_no_space_in_a_manager_save(small_fs):
    m = CheckpointManager(small_fs / "run", keep_last=2)
    m.save(small_state(1.0), 1)
    with pytest.raises(OSError) as info:
        m.save(big_state(), 2)
    _check_no_space(info.value, small_fs)
    assert m.latest() == 1
    assert [(i.name, i.status) for i in list_checkpoints(small_fs / "run")] == [("step-00000001", "complete")]
    assert sorted(os.listdir(small_fs / "run")) == ["latest", "step-00000001"]
    _check_intact(small_fs / "run" / "step-00000001", 1.0)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_no_space_in_an_async_save(small_fs, mode):
    with AsyncSaver(mode=mode) as saver:
        saver.save(small_state(1.0), small_fs / "ck").result(timeout=120)
        h = saver.save(big_state(), small_fs / "ck")  # returns: the error comes with the result
        with pytest.raises(OSError) as info:
            h.result(timeout=120)
        _check_no_space(info.value, small_fs)
        _check_intact(small_fs / "ck", 1.0)
        assert sorted(os.listdir(small_fs)) == ["ck"]
        # an async manager on the same file system
        with CheckpointManager(small_fs / "run", saver=saver) as m:
            m.save(small_state(3.0), 3).result(timeout=120)
            with pytest.raises(OSError):
                m.save(big_state(), 4).result(timeout=120)
            assert m.latest() == 3
            assert sorted(os.listdir(small_fs / "run")) == ["latest", "step-00000003"]
