"""Real multi-process saves and loads (torch.distributed, gloo on CPU): 2 and 4 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from repo_paths import SUPPORT
from ucp_helpers import same_bytes
from world import run_world

import ucp

WORKER = SUPPORT / "ucp_dist_worker.py"


def run_scenario(scenario: str, world: int, ck: Path, tmp: Path) -> None:
    """Run one scenario of tests/support/ucp_dist_worker.py on ``world`` ranks."""
    init = tmp / f"init-{scenario}-{world}"
    run_world(WORKER, lambda r: [scenario, r, world, init, ck], world, timeout=180)


@pytest.mark.timeout(400)
def test_two_rank_save_then_four_rank_load_and_save(tmp_path):
    """2 ranks save (and check that one failing rank fails them all); 4 ranks load it re-sharded and save."""
    ck = tmp_path / "ck"
    ck.mkdir()
    run_scenario("save2,fail_one", 2, ck, tmp_path)
    m = ucp.read_manifest(ck / "two")
    assert m.topology.mesh == {"dp": 2} and m.metadata == {"who": "test"}
    assert {f.rank for f in m.files.values()} == {0, 1}
    run_scenario("load4", 4, ck, tmp_path)
    # the 4-rank checkpoint back in this single process, into one full tensor
    from ucp_dist_worker import M, Z  # same seeds

    into = {"m": torch.zeros(8, 8), "z": ucp.ShardedTensor(torch.zeros(6, 2), (6, 5), (0, 3))}
    ucp.load(ck / "four", into=into)
    assert same_bytes(into["m"], M) and same_bytes(into["z"].local, Z[:, 3:].contiguous())
    assert ucp.read_manifest(ck / "four").topology.mesh == {"dp": 2, "tp": 2}
    assert ucp.verify(ck / "four").ok and ucp.verify(ck / "two").ok
