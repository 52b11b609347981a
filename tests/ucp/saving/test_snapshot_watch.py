"""Deferred snapshots (``AsyncSaver(snapshot="background" | "none")``) refuse to commit a tensor that
changed in place before they finished reading it: the save fails naming it, the previous checkpoint
stays, and nothing half-new is ever committed."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from ucp_helpers import assert_same_state, random_tensor

import ucp
from ucp.format.tree import encode_state
from ucp.saving.async_save import AsyncSaver
from ucp.saving.background.image import Progress
from ucp.saving.plan import plan_save
from ucp.saving.snapshot import ChangeWatch, snapshot_into
from ucp.saving.staging import HostArena

MODES = ["thread", "process"]


def state(seed: int) -> dict:
    return {
        "model": {
            "w": random_tensor(torch.float32, (512, 256), seed),
            "t": random_tensor(torch.float64, (32, 16), seed + 1).t(),  # non-contiguous: copied at once
            "b": random_tensor(torch.bfloat16, (300,), seed + 2),
        },
        "step": seed,
    }


@pytest.mark.parametrize("mode", MODES)
def test_a_change_before_the_background_copy_fails_the_save_and_keeps_the_previous_checkpoint(
    tmp_path, mode, monkeypatch
):
    module = sys.modules["ucp.saving.snapshot"]
    real, release = module.snapshot_into, threading.Event()

    def held_back(*args, **kw):  # the copy starts only when the test says so
        assert release.wait(60)
        return real(*args, **kw)

    old = state(1)
    ucp.save(old, tmp_path / "ck", step=1)
    new = state(2)
    monkeypatch.setattr(module, "snapshot_into", held_back)
    with AsyncSaver(mode=mode, snapshot="background") as saver:
        h = saver.save(new, tmp_path / "ck", step=2)
        new["model"]["b"].add_(1)  # the optimizer step, without wait_snapshot() first
        release.set()
        with pytest.raises(ucp.CheckpointError, match=r"tensor 'model\.b' was changed in place"):
            h.result(timeout=120)
        monkeypatch.setattr(module, "snapshot_into", real)
        saver.save(new, tmp_path / "next", step=3).result(timeout=120)  # the saver still works
    assert_same_state(old, ucp.load(tmp_path / "ck"))  # the previous checkpoint, untouched
    assert sorted(os.listdir(tmp_path)) == ["ck", "next"]  # no temporary directory left
    assert_same_state(new, ucp.load(tmp_path / "next"))


def test_a_change_before_a_tensor_snapshot_is_written_fails_the_save(tmp_path, monkeypatch):
    background = sys.modules["ucp.saving.background.execute"]
    real, release = background.write_rank_file, threading.Event()

    def held_back(*args, **kw):  # the writer reads the tensors only when the test says so
        assert release.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(background, "write_rank_file", held_back)
    s = state(3)
    with AsyncSaver(snapshot="none") as saver:
        h = saver.save(s, tmp_path / "ck", step=3)
        s["model"]["w"].mul_(2)
        release.set()
        with pytest.raises(ucp.CheckpointError, match=r"tensor 'model\.w' was changed in place"):
            h.result(timeout=120)
        h.wait_snapshot(timeout=10)  # the tensors were given back all the same
    assert os.listdir(tmp_path) == []


def test_changes_after_wait_snapshot_and_copied_tensors_are_not_errors(tmp_path):
    s = state(4)
    expected = {"model": {k: v.clone() for k, v in s["model"].items()}, "step": 4}
    with torch.inference_mode():
        s["model"]["inf"] = torch.arange(10.0)  # no version counter: not watched, still saved
    expected["model"]["inf"] = torch.arange(10.0)
    with AsyncSaver(snapshot="none") as saver:
        h = saver.save(s, tmp_path / "none", step=4)
        s["model"]["t"].zero_()  # non-contiguous: snapshot() copied it before save() returned
        h.wait_snapshot(timeout=120)
        s["model"]["w"].zero_()
        h.result(timeout=120)
    s = state(4)
    with AsyncSaver(snapshot="background") as saver:
        h = saver.save(s, tmp_path / "bg", step=4)
        h.wait_snapshot(timeout=120)
        s["model"]["w"].zero_()
        h.result(timeout=120)
    expected_bg = {k: v for k, v in expected.items()}
    expected_bg["model"] = {k: v for k, v in expected["model"].items() if k != "inf"}
    assert_same_state(expected_bg, ucp.load(tmp_path / "bg"))
    with torch.inference_mode():
        loaded = ucp.load(tmp_path / "none")
    assert_same_state(expected, loaded)


def test_the_writer_never_gets_the_last_byte_of_a_torn_snapshot():
    s = state(5)
    leaves = encode_state(s).leaves
    plan = plan_save(leaves, 0, 1)
    watch = ChangeWatch(plan, leaves)
    arena = HostArena(plan.file_size)
    progress = Progress(plan.file_size)
    last = max(range(len(plan.pieces)), key=lambda i: plan.pieces[i].offset)
    tensor = s["model"][plan.pieces[last].name.split(".")[-1]]
    real_advance = progress.advance

    def advance(n: int) -> None:  # the last piece is copied: training changes it right then
        real_advance(n)
        if n >= plan.pieces[last].offset + plan.pieces[last].length - 1:
            tensor.add_(1)

    progress.advance = advance
    with pytest.raises(ucp.SnapshotChangedError) as err:
        snapshot_into(plan, leaves, arena, progress, lambda d: None, watch=watch)
    assert err.value.tensor == plan.pieces[last].name
    assert progress.ready < plan.file_size  # a writer following the copy is still waiting
    arena.close()
