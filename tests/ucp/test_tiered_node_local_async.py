"""Asynchronous saves to a node-local tier, on two real ranks (gloo) with a directory each and no shared file
system: the local commits meet on the store, every rank uploads its own file, and rank 0 commits the remote
copy only after every rank's upload — a rank whose upload fails leaves no remote manifest and an error."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from fault_proxy import FaultProxy
from repo_paths import SUPPORT
from s3_endpoint import object_keys, s3_bucket, s3_server  # noqa: F401
from tiered_async_worker import full
from training_helpers import run_world

import ucp


def seen(out: Path, kind: str, rank: int) -> dict:
    return json.loads((out / f"{kind}-rank{rank}.json").read_text())


def test_async_node_local_saves_commit_remotely_after_every_ranks_upload(s3_server, s3_bucket, tmp_path):  # noqa: F811
    port = int(s3_server.url.rsplit(":", 1)[1])
    # rank 1 reaches the store through a proxy that refuses the upload of its data file of step 3 (and
    # nothing else: its handshake and marker requests pass), with no retries
    proxy = FaultProxy(port).start()
    proxy.plan = lambda method, target, n: "503" if "bad/step-00000003/rank-00001" in target else None
    ok, bad, lost = f"s3://{s3_bucket}/ok", f"s3://{s3_bucket}/bad", f"s3://{s3_bucket}/lost"
    scenarios = [
        {"kind": "ok", "remote": ok, "steps": [1, 2]},
        {
            "kind": "upload-fails",
            "remote": bad,
            "steps": [3],
            "options": {"1": {"endpoint_url": proxy.url, "max_retries": 0}},
        },
        {  # rank 1 cannot reach the store at all: neither local copy is committed
            "kind": "unreachable",
            "remote": lost,
            "steps": [4],
            "options": {"1": {"endpoint_url": "http://127.0.0.1:9", "max_retries": 0, "connect_timeout": 1}},
            "commit_timeout": 3,
        },
    ]
    try:
        run_world(2, scenarios, tmp_path, timeout=120, worker=SUPPORT / "tiered_async_worker.py")
    finally:
        proxy.stop()

    # both steps committed locally on each node (its own file and the manifest) and remotely
    for rank in (0, 1):
        got = seen(tmp_path, "ok", rank)
        assert got["handles"] == ["SaveHandle", "SaveHandle"] and got["errors"] == []
        assert f"step-00000002/rank-0000{rank}.safetensors" in got["local"]
        assert "step-00000002/manifest.json" in got["local"]
        assert not any(f"rank-0000{1 - rank}" in f for f in got["local"])  # no shared file system
    keys = object_keys(s3_server, s3_bucket, "ok/")
    assert [k for k in keys if "/." in k] == []  # reports, go-ahead and markers went with the commit
    assert {"ok/step-00000002/manifest.json", "ok/step-00000002/rank-00001.safetensors"} <= set(keys)
    for step in (1, 2):  # from the remote alone, bit-exact
        loaded = ucp.load(f"{ok}/step-{step:08d}")
        assert torch.equal(loaded["w"], full(step)) and loaded["step"] == step

    # the failed upload: committed on both disks, never on the store; both ranks report it
    assert not [k for k in object_keys(s3_server, s3_bucket, "bad/") if k.endswith("manifest.json")]
    err0, err1 = seen(tmp_path, "upload-fails", 0)["errors"], seen(tmp_path, "upload-fails", 1)["errors"]
    assert len(err0) == 1 and "rank 1 failed to upload its files" in err0[0] and "not committed" in err0[0]
    assert len(err1) == 1 and "bad/step-00000003/rank-00001.safetensors" in err1[0]
    for rank in (0, 1):
        assert "step-00000003/manifest.json" in seen(tmp_path, "upload-fails", rank)["local"]

    # rank 1 could not hand in its report: rank 0 gives up naming it, rank 1 names the object; nothing committed
    err0, err1 = seen(tmp_path, "unreachable", 0)["errors"], seen(tmp_path, "unreachable", 1)["errors"]
    assert len(err0) == 1 and f"rank(s) [1] did not report to {lost}/step-00000004 within 3s" in err0[0]
    assert len(err1) == 1 and f"{lost}/step-00000004/.ucp-report-" in err1[0]
    for rank in (0, 1):  # no step directory, and no temporary one left
        assert [f for f in seen(tmp_path, "unreachable", rank)["local"] if "step-00000004" in f] == []
    assert not [k for k in object_keys(s3_server, s3_bucket, "lost/") if k.endswith("manifest.json")]
