"""CheckpointManager's ``latest``: never older than a complete newer checkpoint.

A pointer that cannot be written after a committed save is a warning (the save succeeded, no
temporary file is left, and "latest" resolves from the complete checkpoints); two managers on one
root committing steps out of order leave ``latest`` at the highest complete step; a stale pointer
naming an older step does not make load() read it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

import ucp
from ucp.manager import LATEST, read_latest, step_name, write_latest


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(step))}


def test_unwritable_pointer_does_not_fail_a_committed_save(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "run"
    manager = ucp.CheckpointManager(root)
    manager.save(_state(1), 1)
    (root / LATEST).unlink()
    (root / LATEST).mkdir()  # a directory cannot be replaced by a file, whoever we run as (root too)
    with caplog.at_level(logging.WARNING, logger="ucp.manager"):
        manifest = manager.save(_state(2), 2)
    assert manifest.step == 2
    assert any("could not be updated" in r.getMessage() and step_name(2) in r.getMessage() for r in caplog.records)
    assert [n for n in os.listdir(root) if n.startswith(".latest.tmp-")] == []
    assert manager.latest() == 2
    assert torch.equal(manager.load()["w"], _state(2)["w"])
    assert manager.loaded_step == 2


def test_managers_saving_out_of_order_leave_latest_at_the_highest_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    first, second = ucp.CheckpointManager(root), ucp.CheckpointManager(root)
    first.save(_state(30), 30)
    second.save(_state(29), 29)  # committed after 30: the pointer must not move back
    assert read_latest(root) == (30, step_name(30))
    assert first.latest() == second.latest() == 30
    assert torch.equal(second.load()["w"], _state(30)["w"])
    second.save(_state(31), 31)  # and forward it still moves
    assert read_latest(root) == (31, step_name(31))


def test_write_latest_only_moves_forward_over_complete_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "run"
    ucp.CheckpointManager(root).save(_state(30), 30)
    assert write_latest(root, 29, step_name(29)) is False
    assert read_latest(root) == (30, step_name(30))
    ucp.save(_state(10), root / step_name(10))
    os.rename(root / step_name(30), tmp_path / "gone")  # the newer one is no longer there
    assert write_latest(root, 10, step_name(10)) is True
    assert read_latest(root) == (10, step_name(10))


def test_a_stale_older_pointer_resolves_to_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "run"
    manager = ucp.CheckpointManager(root)
    manager.save(_state(5), 5)
    manager.save(_state(6), 6)
    (root / LATEST).write_text(json.dumps({"step": 5, "name": step_name(5)}) + "\n")  # an old writer's pointer
    assert manager.latest() == 6
    assert torch.equal(manager.load()["w"], _state(6)["w"])
    assert manager.loaded_step == 6
