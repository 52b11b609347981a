"""``ucp demo`` end to end (a short run of the tiny model): the crash, the resume, the outputs, the NVMe-offloaded
leg."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

import ucp

ROOT = Path(__file__).resolve().parents[2]


def test_demo_crashes_resumes_reshapes_and_exports(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ucp.cli",
            "demo",
            "--workdir",
            str(work),
            "--model",
            "tiny",
            "--steps",
            "8",
            "--kill-at",
            "4",
            "--save-every",
            "2",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads(res.stdout)
    # the crash came after step 4; checkpoint 4 (saved after step 3) may or may not have been complete
    latest = s["crash"]["latest_complete"]
    assert latest in (2, 4)
    listing = {e["name"]: e["status"] for e in s["crash"]["listing"]}
    assert listing.get(f"step-{latest:08d}") == "complete"
    assert all(e["status"] != "complete" for e in s["crash"]["listing"] if int(e["name"].split("-")[1][:8]) > latest)
    assert s["resume"]["resumed_at"] == latest and s["resume"]["final_step"] == 8
    assert s["resume"]["last_step"] == 7  # as the log numbers steps (from 0)
    # checkpoint N is saved after step N - 1: steps 2 and 4 ran while checkpoints 2 and 4 were written
    first = s["first_run"]
    assert first["checkpoints"] == [2, 4] and first["after_checkpoint_steps"] == [2, 4]
    assert first["median_after_checkpoint_step_s"] > 0 and first["median_other_step_s"] > 0
    # the resumed run repeated the steps from the checkpoint to the crash, with the same losses
    assert s["continuity"]["steps"] == list(range(latest, 5)) and s["continuity"]["max_relative_difference"] <= 1e-5
    # the last checkpoint, consolidated and exported, holds the final weights
    manager = ucp.CheckpointManager(work / "checkpoints")
    assert manager.latest() == 8
    final = ucp.load(manager.path(8))["model"]
    consolidated = ucp.read_manifest(work / "consolidated")
    assert consolidated.topology.world_size == 1 and all(len(t.pieces) == 1 for t in consolidated.tensors.values())
    hf = load_file(work / "hf" / "model.safetensors")
    assert hf.keys() == final.keys()
    for name, t in final.items():
        assert hf[name].equal(t.to(hf[name].dtype)), name
    assert "CRASH" in res.stderr and f"resumed at step {latest}" in res.stderr
    # the NVMe leg: the first steps again with the optimizer state in swap files, saved, resumed; same losses
    o = s["offload"]
    assert o["steps"] == [0, 1, 2] and o["resumed_at"] == 2 and o["max_relative_difference"] <= 1e-5
    assert (
        o["swap_bytes_read"] >= 3 * o["state_bytes_per_rank"]
        and o["swap_bytes_written"] >= 3 * o["state_bytes_per_rank"]
    )
    assert o["checkpoint_tier_read"] >= o["state_bytes_per_rank"] and o["peak_rss"] > o["pool_bytes"] > 0
    assert ucp.CheckpointManager(work / "offload-checkpoints").latest() == 2  # saved after step 1, resumed from
    assert list((work / "nvme").iterdir()) == []  # each run removed its swap directory
    assert "streamed from the swap files" in res.stderr
