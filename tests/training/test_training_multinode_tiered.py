"""Two "nodes" on one machine: ``torchrun --nnodes 2`` twice (c10d rendezvous on loopback), each node
with its own local checkpoint directory and no shared file system, saving tiered checkpoints to the
loopback S3 server; then a resume on one node from the object store alone, whose losses continue the
two-node run's (dp 2 × micro-batch 2 there, dp 1 × micro-batch 4 here: the same global batches)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from s3_endpoint import object_keys, s3_bucket, s3_server  # noqa: F401

ARGS = ["--model", "tiny", "--seq-len", "16", "--lr", "1e-2", "--clip", "1.0", "--sync-save", "--node-local"]


def torchrun() -> str:
    path = Path(sys.executable).with_name("torchrun")
    return str(path) if path.exists() else shutil.which("torchrun") or "torchrun"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lines(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def test_two_nodes_save_tiered_without_a_shared_disk_and_one_node_resumes_from_the_store(
    s3_server,  # noqa: F811
    s3_bucket,  # noqa: F811
    tmp_path,
) -> None:
    remote = f"s3://{s3_bucket}/run"
    port = free_port()
    nodes = []
    for node in (0, 1):
        cmd = [
            torchrun(),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "ucp-tiered",
            "--rdzv-conf",
            f"is_host={'true' if node == 0 else 'false'}",
            "-m",
            "training.run",
            *ARGS,
            "--micro-batch",
            "2",
            "--total-steps",
            "5",
            "--save-every",
            "2",
            "--keep-last",
            "1",
            "--save-dir",
            str(tmp_path / f"node{node}"),
            "--remote",
            remote,
        ]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env()))
    outs = []
    for p in nodes:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            raise
        outs.append(out)
    for p, out in zip(nodes, outs):
        assert p.returncode == 0, out[-4000:]
    records = [r for out in outs for r in lines(out)]  # rank 0 prints (on whichever node it runs)
    first = {r["step"]: r["loss"] for r in records if "step" in r}
    assert sorted(first) == [0, 1, 2, 3, 4] and [r["checkpoint"] for r in records if "checkpoint" in r] == [2, 4]
    assert records[-1]["mesh"] == {"tp": 1, "pp": 1, "dp": 2}

    # every rank's file reached the store once, the commit is there, no markers are left
    keys = object_keys(s3_server, s3_bucket, "run/")
    assert keys == [
        "run/latest",
        "run/step-00000002/manifest.json",
        "run/step-00000002/rank-00000.safetensors",
        "run/step-00000002/rank-00001.safetensors",
        "run/step-00000004/manifest.json",
        "run/step-00000004/rank-00000.safetensors",
        "run/step-00000004/rank-00001.safetensors",
    ], keys
    # each node's disk holds only its own rank's file (local retention kept 1 step per node)
    held = {node: sorted(p.name for p in (tmp_path / f"node{node}" / "step-00000004").iterdir()) for node in (0, 1)}
    assert sorted(held.values()) == [
        ["manifest.json", "rank-00000.safetensors"],
        ["manifest.json", "rank-00001.safetensors"],
    ]
    assert not (tmp_path / "node0" / "step-00000002").exists() and not (tmp_path / "node1" / "step-00000002").exists()

    # both nodes are gone: one node resumes from the object store alone, and its losses continue the run
    shutil.rmtree(tmp_path / "node0")
    shutil.rmtree(tmp_path / "node1")
    cmd = [sys.executable, "-m", "training.run", *ARGS[:-2], "--micro-batch", "4", "--total-steps", "6"]
    cmd += ["--save-dir", str(tmp_path / "fresh"), "--remote", remote, "--resume", "--sync-save"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    second = lines(done.stdout)
    assert second[0]["resumed"] == 4 and second[0]["from"] == remote
    resumed = {r["step"]: r["loss"] for r in second if "step" in r}
    assert sorted(resumed) == [4, 5]
    assert resumed[4] == pytest.approx(first[4], rel=1e-4)
