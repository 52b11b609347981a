"""Real multi-process saves and loads (torch.distributed, gloo on CPU): 2 and 4 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import SUPPORT
from ucp_helpers import same_bytes

import ucp

WORKER = SUPPORT / "ucp_dist_worker.py"


def run_world(scenario: str, world: int, ck: Path, tmp: Path) -> None:
    init = tmp / f"init-{scenario}-{world}"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(r), str(world), str(init), str(ck)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    failed = [(r, o) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode != 0]
    assert not failed, "\n".join(f"--- rank {r} ---\n{o[-3000:]}" for r, o in failed)


@pytest.mark.timeout(400)
def test_two_rank_save_then_four_rank_load_and_save(tmp_path):
    """2 ranks save (and check that one failing rank fails them all); 4 ranks load it re-sharded and save."""
    ck = tmp_path / "ck"
    ck.mkdir()
    run_world("save2,fail_one", 2, ck, tmp_path)
    m = ucp.read_manifest(ck / "two")
    assert m.topology.mesh == {"dp": 2} and m.metadata == {"who": "test"}
    assert {f.rank for f in m.files.values()} == {0, 1}
    run_world("load4", 4, ck, tmp_path)
    # the 4-rank checkpoint back in this single process, into one full tensor
    from ucp_dist_worker import M, Z  # same seeds

    into = {"m": torch.zeros(8, 8), "z": ucp.ShardedTensor(torch.zeros(6, 2), (6, 5), (0, 3))}
    ucp.load(ck / "four", into=into)
    assert same_bytes(into["m"], M) and same_bytes(into["z"].local, Z[:, 3:].contiguous())
    assert ucp.read_manifest(ck / "four").topology.mesh == {"dp": 2, "tp": 2}
    assert ucp.verify(ck / "four").ok and ucp.verify(ck / "two").ok
