"""CheckpointManager on an object store (the loopback S3 server): ``latest`` written after the commit,
retention by whole prefixes, and kill -9 of saving processes at random moments."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from s3_endpoint import object_keys, s3_bucket, s3_server  # noqa: F401

import ucp

WORKER = os.path.join(os.path.dirname(__file__), "..", "support", "s3_kill_worker.py")


def test_latest_retention_and_leftovers_on_an_object_store(s3_server, s3_bucket):  # noqa: F811
    url = f"s3://{s3_bucket}/run"
    client = s3_server.client()
    manager = ucp.CheckpointManager(url, keep_last=2)
    for step in (1, 2, 3):
        manager.save({"w": torch.full((4,), float(step))}, step)
        assert json.loads(client.get_object(Bucket=s3_bucket, Key="run/latest")["Body"].read()) == {
            "step": step,
            "name": f"step-{step:08d}",
        }
    # the oldest whole prefix is gone; the two newest stay
    assert [k for k in object_keys(s3_server, s3_bucket) if k.endswith("manifest.json")] == [
        "run/step-00000002/manifest.json",
        "run/step-00000003/manifest.json",
    ]
    assert not any(k.startswith("run/step-00000001/") for k in object_keys(s3_server, s3_bucket))
    # an interrupted save of step 4 (data, no manifest) is incomplete: never loaded, never "latest"
    client.put_object(Bucket=s3_bucket, Key="run/step-00000004/.ucp-saving", Body=b"")
    client.put_object(Bucket=s3_bucket, Key="run/step-00000004/rank-00000.safetensors", Body=b"x" * 64)
    infos = {i.step: i for i in manager.list()}
    assert infos[4].status == "incomplete" and "interrupted" in (infos[4].detail or "")
    assert manager.latest() == 3
    assert manager.load()["w"][0].item() == 3.0 and manager.loaded_step == 3
    # a stale pointer (names a deleted step) does not hide the newest complete checkpoint
    client.put_object(Bucket=s3_bucket, Key="run/latest", Body=b'{"step": 1, "name": "step-00000001"}')
    assert manager.latest() == 3
    # the save of step 5 replaces nothing complete, removes the older leftover 4? no: 4 > 3 could be in flight
    manager.save({"w": torch.full((4,), 5.0)}, 5)
    steps = {i.step: i.status for i in manager.list()}
    assert steps == {3: "complete", 4: "incomplete", 5: "complete"}
    manager.save({"w": torch.full((4,), 6.0)}, 6)  # now 4 is older than the newest complete: a leftover
    assert {i.step: i.status for i in manager.list()} == {5: "complete", 6: "complete"}
    # re-saving over an interrupted save of the same step replaces it
    client.put_object(Bucket=s3_bucket, Key="run/step-00000007/.ucp-saving", Body=b"")
    manager.save({"w": torch.full((4,), 7.0)}, 7)
    assert ucp.load(manager.path(7))["w"][0].item() == 7.0


def test_kill_9_while_saving_never_yields_a_partial_checkpoint_nor_loses_the_previous(s3_server, s3_bucket):  # noqa: F811
    env = {**os.environ, **s3_server.env()}
    proc = subprocess.run(
        [sys.executable, WORKER, f"s3://{s3_bucket}/run", "20", "20261202"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    trials = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(trials) == 20, proc.stdout + proc.stderr
    problems = [t for t in trials if t["problem"] is not None]
    assert not problems, problems
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(1 for t in trials if t["saved"]) >= 10  # half the kills came after a save had returned
