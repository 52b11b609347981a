"""Resuming through ucp: ``Engine.save`` on one mesh, ``Engine.load`` on another, the same losses.

An uninterrupted run gives the losses of steps 0..5. Runs on other meshes train steps 0..2, save
step 3 with a ``ucp.CheckpointManager``, and fresh engines on other meshes and ZeRO stages load it
(each rank reading only its own regions) and train steps 3..5: their losses must be the
uninterrupted run's. The multi-process phases run in real gloo processes of
tests/support/training_resume_worker.py (started by training_helpers.run_world).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from repo_paths import SUPPORT
from training_helpers import rel_close, run_world
from training_resume_worker import DP1, DP2, SPLIT, STEPS, engine

import ucp
from reshard import Mesh
from ucp.conversion.placement import place, recorded_layout
from ucp.conversion.reshape import reshape

WORKER = SUPPORT / "training_resume_worker.py"


# -- the test side ---------------------------------------------------------------------------------


def spawn(world: int, scenarios: list[dict], out: Path) -> dict[str, list[float]]:
    """Run ``scenarios`` on ``world`` worker processes; their losses by scenario name."""
    run_world(world, scenarios, out, timeout=60, worker=WORKER)
    return {sc["name"]: json.loads((out / f"{sc['name']}.losses.json").read_text()) for sc in scenarios}


def save(name: str, root: Path, mesh: dict[str, int], **options: Any) -> dict:
    return {"name": name, "action": "save", "root": str(root), "mesh": mesh, "options": options}


def load(name: str, root: Path, mesh: dict[str, int], **options: Any) -> dict:
    return {"name": name, "action": "load", "root": str(root), "mesh": mesh, "options": options}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Uninterrupted losses, and the losses of every save and resume (three launches)."""
    base = tmp_path_factory.mktemp("resume")
    ck = {k: base / k for k in ("dp2_z1", "dp2_z3_async", "tp2dp2_z2")}
    e = engine({}, zero_stage=0, **DP1)
    losses = {"uninterrupted": [e.train_step() for _ in range(STEPS)]}
    losses |= spawn(
        2,
        [
            # async, written straight from the live tensors while training goes on (the engine waits for
            # the write before its optimizer step)
            save("save_dp2_z1", ck["dp2_z1"], {"dp": 2}, zero_stage=1, **DP2) | {"async": True, "snapshot": "none"},
            # async, copied in the background
            save("save_dp2_z3_async", ck["dp2_z3_async"], {"dp": 2}, zero_stage=3, zero_alignment=4, **DP2)
            | {"async": True, "snapshot": "background"},
            load("dp2_z3_to_dp2_z1", ck["dp2_z3_async"], {"dp": 2}, zero_stage=1, **DP2),
        ],
        base / "w2a",
    )
    losses |= spawn(
        4,
        [
            load("dp2_z1_to_tp2dp2_z3", ck["dp2_z1"], {"tp": 2, "dp": 2}, zero_stage=3, zero_alignment=2, **DP2),
            save("save_tp2dp2_z2", ck["tp2dp2_z2"], {"tp": 2, "dp": 2}, zero_stage=2, **DP2),
        ],
        base / "w4",
    )
    # ucp reshape: the tp2 x dp2 ZeRO-2 checkpoint rewritten for dp2 ZeRO-1, and consolidated
    src = ucp.CheckpointManager(ck["tp2dp2_z2"]).path(SPLIT)
    layout = recorded_layout(ucp.read_manifest(src)).layout
    assert layout is not None
    target = layout.replace(mesh=Mesh(dp=2), zero=layout.zero.model_copy(update={"stage": 1}))
    ck["reshaped_dp2_z1"] = base / "reshaped_dp2_z1"
    ck["consolidated"] = base / "consolidated"
    reshape(src, ucp.CheckpointManager(ck["reshaped_dp2_z1"]).path(SPLIT), layout=target, memory_budget=1 << 20)
    reshape(src, ucp.CheckpointManager(ck["consolidated"]).path(SPLIT))
    losses |= spawn(
        2,
        [
            load("tp2dp2_z2_to_dp2_z1", ck["tp2dp2_z2"], {"dp": 2}, zero_stage=1, **DP2),
            load("reshaped_to_dp2_z1", ck["reshaped_dp2_z1"], {"dp": 2}, zero_stage=1, **DP2),
        ],
        base / "w2b",
    )
    return {"losses": losses, "ck": ck}


def test_saving_runs_match_the_uninterrupted_run(runs: dict[str, Any]) -> None:
    losses = runs["losses"]
    for name in ("save_dp2_z1", "save_dp2_z3_async", "save_tp2dp2_z2"):
        # the async save's run kept training while it was written
        assert rel_close(losses[name], losses["uninterrupted"], 1e-5), (name, losses[name])


@pytest.mark.parametrize(
    "name", ["dp2_z3_to_dp2_z1", "dp2_z1_to_tp2dp2_z3", "tp2dp2_z2_to_dp2_z1", "reshaped_to_dp2_z1"]
)
def test_resumed_run_continues_the_losses(runs: dict[str, Any], name: str) -> None:
    losses = runs["losses"]
    assert rel_close(losses[name], losses["uninterrupted"][SPLIT:], 1e-5), (losses[name], losses["uninterrupted"])


def test_checkpoint_records_topology(runs: dict[str, Any]) -> None:
    manager = ucp.CheckpointManager(runs["ck"]["tp2dp2_z2"])
    assert manager.latest() == SPLIT
    manifest = ucp.read_manifest(manager.path(SPLIT))
    assert manifest.step == SPLIT
    assert manifest.topology.world_size == 4 and manifest.topology.mesh == {"tp": 2, "pp": 1, "dp": 2}
    meta = manifest.metadata
    assert {k: meta[k] for k in ("mesh", "zero_stage", "dtype", "data_position")} == {
        "mesh": {"tp": 2, "pp": 1, "dp": 2},
        "zero_stage": 2,
        "dtype": "fp32",
        "data_position": SPLIT,
    }
    recorded = recorded_layout(manifest)
    assert recorded.layout is not None and recorded.layout.mesh == Mesh(tp=2, dp=2)
    assert recorded.layout.zero.stage == 2 and recorded.shapes is not None


def test_reshaped_checkpoint_is_one_file_per_rank(runs: dict[str, Any]) -> None:
    """After ``reshape`` every region a dp2 ZeRO-1 rank saves lies in that rank's own file."""
    path = ucp.CheckpointManager(runs["ck"]["reshaped_dp2_z1"]).path(SPLIT)
    manifest = ucp.read_manifest(path)
    recorded = recorded_layout(manifest)
    assert recorded.layout is not None and recorded.shapes is not None
    assert manifest.topology.mesh == {"tp": 1, "pp": 1, "dp": 2} and recorded.layout.zero.stage == 1
    placements = place(manifest, recorded.layout, recorded.shapes)
    for rank, mine in enumerate(placements.ranks):
        for p in mine:
            [piece] = [q for q in manifest.tensors[p.tensor].pieces if q.region() == p.region]
            assert piece.file == f"rank-{rank:05d}.safetensors", (p, piece.file)
    consolidated = ucp.read_manifest(ucp.CheckpointManager(runs["ck"]["consolidated"]).path(SPLIT))
    assert len(consolidated.files) == 1 and all(len(t.pieces) == 1 for t in consolidated.tensors.values())


@pytest.mark.parametrize("ck", ["tp2dp2_z2", "dp2_z1", "consolidated"])
def test_single_process_resumes_a_multi_rank_checkpoint(runs: dict[str, Any], ck: str) -> None:
    """World 4 or 2 -> 1, in this process, loading a checkpoint directory rather than through a manager."""
    e = engine({}, zero_stage=1, **DP1)
    start = e.load(ucp.CheckpointManager(runs["ck"][ck]).path(SPLIT))
    losses = [e.train_step() for _ in range(start, STEPS)]
    assert start == SPLIT
    assert rel_close(losses, runs["losses"]["uninterrupted"][SPLIT:], 1e-5), losses
