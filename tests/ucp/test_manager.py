"""CheckpointManager: step directories, the ``latest`` pointer, retention, fallback, leftovers."""

from __future__ import annotations

import fcntl
import json
import os

import pytest  # noqa: E402
import torch  # noqa: E402
from ucp_helpers import assert_same_state, random_tensor  # noqa: E402

import ucp  # noqa: E402
from ucp.manager import CheckpointManager, list_checkpoints, read_latest  # noqa: E402
from ucp.saving.async_save import SaveHandle  # noqa: E402


def state_at(step: int) -> dict:
    return {
        "model": {"w": random_tensor(torch.float32, (32, 16), step), "b": torch.full((4,), float(step))},
        "step": step,
    }


def statuses(root) -> dict[str, str]:
    return {i.name: i.status for i in list_checkpoints(root)}


def test_saves_steps_moves_latest_and_keeps_the_last_n(tmp_path):
    m = CheckpointManager(tmp_path / "run", keep_last=2)
    assert m.latest() is None and m.list() == []
    with pytest.raises(ucp.NotACheckpointError):
        m.load()
    for step in (10, 20, 30, 40):
        manifest = m.save(state_at(step), step)
        assert manifest.step == step
        assert m.latest() == step
    infos = m.list()
    assert [(i.step, i.name, i.status, i.latest) for i in infos] == [
        (30, "step-00000030", "complete", False),
        (40, "step-00000040", "complete", True),
    ]
    assert all(i.size > 0 and i.created is not None for i in infos)
    assert json.loads((tmp_path / "run" / "latest").read_text()) == {"step": 40, "name": "step-00000040"}
    assert sorted(os.listdir(tmp_path / "run")) == ["latest", "step-00000030", "step-00000040"]
    assert_same_state(state_at(40), m.load())
    assert m.loaded_step == 40
    assert_same_state(state_at(30), m.load(30))
    into = {"model": {"w": torch.zeros(32, 16), "b": torch.zeros(4)}, "step": 0}
    m.load(into=into)
    assert_same_state(state_at(40), into)


def test_retention_never_deletes_latest(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=1)
    m.save(state_at(50), 50)
    m.save(state_at(5), 5)  # a lower step saved last (e.g. a restart from an older checkpoint)
    assert m.latest() == 50  # latest never moves back past a complete newer checkpoint
    # neither latest's checkpoint nor the one just saved is deleted, whatever keep_last says
    assert statuses(tmp_path) == {"step-00000005": "complete", "step-00000050": "complete"}
    m2 = CheckpointManager(tmp_path, keep_last=2)
    m2.save(state_at(70), 70)
    m2.save(state_at(7), 7)
    assert statuses(tmp_path) == {"step-00000007": "complete", "step-00000070": "complete"}
    assert m2.latest() == 70


def test_load_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    m = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        m.save(state_at(step), step)
    # the latest checkpoint's data file is damaged (truncated)
    data = tmp_path / "step-00000003" / "rank-00000.safetensors"
    os.truncate(data, data.stat().st_size - 100)
    assert statuses(tmp_path)["step-00000003"] == "corrupt"
    assert m.latest() == 2
    assert_same_state(state_at(2), m.load())
    assert m.loaded_step == 2
    with pytest.raises(ucp.CheckpointError):
        m.load(3)  # an explicit step never falls back
    # latest names a checkpoint that is gone entirely; a corrupted CRC only shows when reading
    import shutil

    shutil.rmtree(tmp_path / "step-00000003")
    with open(tmp_path / "step-00000002" / "rank-00000.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    assert read_latest(tmp_path) == (3, "step-00000003")
    assert_same_state(state_at(1), m.load())  # 3 missing, 2 fails its CRC check, 1 is fine
    assert m.loaded_step == 1
    (tmp_path / "latest").write_text("garbage")
    assert m.latest() == 2  # pointer unreadable: newest complete by the cheap check


def test_leftovers_are_listed_never_loaded_and_cleaned_by_the_next_save(tmp_path):
    m = CheckpointManager(tmp_path)
    m.save(state_at(1), 1)
    # a killed save of step 2: temp dir with a partial data file (no manifest); a retired old one
    tmp = tmp_path / ".step-00000002.tmp-0123456789ab"
    tmp.mkdir()
    (tmp / "rank-00000.safetensors").write_bytes(b"\0" * 1000)
    old = tmp_path / ".step-00000001.old-0123456789ab"
    old.mkdir()
    (tmp_path / ".latest.tmp-0123456789ab").write_text("{}")
    # a save in flight elsewhere holds its temp dir
    busy = tmp_path / ".step-00000003.tmp-aaaaaaaaaaaa"
    busy.mkdir()
    fd = os.open(busy, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        assert statuses(tmp_path) == {
            "step-00000001": "complete",
            ".step-00000001.old-0123456789ab": "old",
            ".step-00000002.tmp-0123456789ab": "temp",
            ".step-00000003.tmp-aaaaaaaaaaaa": "saving",
        }
        assert m.latest() == 1
        assert_same_state(state_at(1), m.load())
        m.save(state_at(4), 4)
        assert sorted(os.listdir(tmp_path)) == [
            ".step-00000003.tmp-aaaaaaaaaaaa",
            "latest",
            "step-00000001",
            "step-00000004",
        ]
    finally:
        os.close(fd)
    m.save(state_at(5), 5)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_a_step_directory_without_manifest_is_incomplete(tmp_path):
    m = CheckpointManager(tmp_path)
    m.save(state_at(1), 1)
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / "manifest.json").write_text("{not json")
    assert statuses(tmp_path) == {
        "step-00000001": "complete",
        "step-00000002": "incomplete",
        "step-00000003": "corrupt",
    }
    assert m.latest() == 1
    assert_same_state(state_at(1), m.load())


def test_async_manager_moves_latest_after_the_commit(tmp_path):
    """(Process mode: the writer process moves the pointer — see test_ucp_crash.py's async trials.)"""
    with CheckpointManager(tmp_path, keep_last=2, async_save=True) as m:
        for step in (1, 2, 3):
            state = state_at(step)
            h = m.save(state, step)
            assert isinstance(h, SaveHandle)
            state["model"]["w"].zero_()  # training goes on
            if step == 2:
                h.result(timeout=120)
                assert m.latest() == 2  # the pointer moved before result() returned
        m.wait()
        assert m.latest() == 3
        assert [i.step for i in m.list()] == [2, 3]
        assert_same_state(state_at(3), m.load())
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_manager_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path).save({}, -1)  # (URL roots are object stores: tests/ucp/test_s3_manager.py)


def test_cleaning_leftovers_never_breaks_a_pointer_being_written(tmp_path):
    """A save's commit moves ``latest`` (on the writer thread) while the next save cleans leftovers."""
    import threading

    from ucp.manager import clean_leftovers, write_latest

    held = tmp_path / ".latest.tmp-0123abcd"
    held.write_text("{}")
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as write_latest holds it
    assert clean_leftovers(tmp_path) == [] and held.exists()
    os.close(fd)
    assert clean_leftovers(tmp_path) == [held.name] and not held.exists()

    stop = threading.Event()

    def cleaner() -> None:
        while not stop.is_set():
            clean_leftovers(tmp_path)

    t = threading.Thread(target=cleaner)
    t.start()
    try:
        for step in range(300):
            write_latest(tmp_path, step, f"step-{step:08d}")
            assert read_latest(tmp_path) == (step, f"step-{step:08d}")
    finally:
        stop.set()
        t.join()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".latest.tmp-")]
