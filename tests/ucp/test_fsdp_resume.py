"""FSDP2 (``fully_shard``) and FSDP x TP models saved with ``ucp.save_state`` resume at another world
size and mesh with their losses continuing, bit-identical to a DCP resume (real gloo processes).

One world of 4 processes (tests/support/fsdp_resume_worker.py). 2 ranks (FSDP on a 1-D mesh, in
their own 2-rank process group) train 2 steps and save (UCP and DCP); 4 ranks resume from it three
ways (FSDP on 4 ranks from UCP and from DCP, FSDP x TP on a 2x2 mesh from UCP), take step 3, and
the 2-D and the 4-rank FSDP models are saved; 2 ranks resume from each and take step 4. Every loss must
match the uninterrupted 2-rank run's within 1e-5 (relative). Scheduler and AdamW step counts are
restored into fresh optimizers (the worker checks them); the manifests record each tensor's
placement as a dim pattern, and each shard is written once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import SUPPORT
from world import run_world

import ucp

WORKER = SUPPORT / "fsdp_resume_worker.py"


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    run_world(WORKER, lambda r: [r, 4, out / "init", out], 4, timeout=240)
    return out


def test_losses_continue_across_world_sizes_and_meshes(runs: Path) -> None:
    losses = json.loads((runs / "losses.json").read_text())
    ref, at4, at2 = losses["ref"], losses["at4"], losses["at2"]
    assert ref[3] < ref[0]  # it trains
    assert at4["a"] == at4["b"], "UCP and DCP resumes differ"
    for key in ("a", "b", "c"):
        assert _close(at4[key], ref[2]), (key, at4[key], ref[2])
    for key in ("d", "f"):
        assert _close(at2[key], ref[3]), (key, at2[key], ref[3])


def test_manifests_record_placements_and_write_each_shard_once(runs: Path) -> None:
    one = ucp.read_manifest(runs / "ucp1d")
    rec = one.metadata["dtensor"]
    assert rec["model.0.weight"] == {
        "mesh": {"dp": 2},
        "placements": ["Shard(dim=0)"],
        "dims": "(dp d0) d1",
        "axes": {"dp": "dp"},
    }
    assert rec["model.2.weight"]["dims"] == "(dp d0 | uneven=ceil) d1"  # 5 rows over 2 ranks
    assert rec["optimizer.state.2.weight.exp_avg"]["dims"] == "(dp d0 | uneven=ceil) d1"
    assert [p.box.offsets[0] for p in one.tensors["model.2.weight"].pieces] == [0, 3]  # type: ignore[union-attr]

    two = ucp.read_manifest(runs / "ucp2d")
    rec = two.metadata["dtensor"]
    assert rec["model.0.weight"]["placements"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    assert rec["model.0.weight"]["dims"] == "(tp dp d0) d1"  # FSDP over TP: tp major
    assert rec["model.2.weight"]["dims"] == "(dp d0 | uneven=ceil) (tp d1)"
    assert rec["model.2.bias"]["placements"] == ["Shard(dim=0)", "Replicate()"]
    pieces = {n: e.pieces for n, e in two.tensors.items()}
    # the colwise weight: 4 shards, each by its own rank; the bias replicated over tp: once per dp shard
    assert sorted(two.files[p.file].rank for p in pieces["model.0.weight"]) == [0, 1, 2, 3]
    assert len(pieces["model.2.bias"]) == 2
    assert ucp.verify(runs / "ucp2d").ok
