"""Tiered checkpoints: local commit, background replication to the loopback S3 server, per-tier
retention, and a restore from the remote tier when the local copy is gone or damaged."""

from __future__ import annotations

import json
import os
import shutil

import torch
from s3_endpoint import object_keys, s3_bucket, s3_server  # noqa: F401
from typer.testing import CliRunner

import ucp
from ucp.cli.main import app


def state(step: int) -> dict:
    return {"w": torch.full((256, 1024), float(step)) + torch.arange(1024), "step": step}


def test_tiered_saves_replicate_and_restore_from_the_remote_tier(s3_server, s3_bucket, tmp_path):  # noqa: F811
    remote = f"s3://{s3_bucket}/run"
    with ucp.CheckpointManager(tmp_path / "ckpt", keep_last=1, remote=remote, remote_keep_last=2) as m:
        for step in (1, 2, 3):
            m.save(state(step), step)
        m.wait()
        assert sorted(m.replicator.replicated) == ["step-00000001", "step-00000002", "step-00000003"]
        assert [i.step for i in m.list()] == [3]  # local retention ran after replication
        assert [(i.step, i.status) for i in m.remote_manager().list()] == [(2, "complete"), (3, "complete")]
        assert m.remote_manager().latest() == 3
        out = m.load()
        assert m.loaded_from == m.root and m.loaded_step == 3 and torch.equal(out["w"], state(3)["w"])
        # ucp ls shows both tiers and what is replicated
        result = CliRunner().invoke(app, ["ls", str(tmp_path / "ckpt"), "--remote", remote, "--json"])
        doc = json.loads(result.stdout)
        assert [(c["step"], c["replicated"]) for c in doc["checkpoints"]] == [(3, True)]
        assert doc["remote"]["latest"] == 3 and [c["step"] for c in doc["remote"]["checkpoints"]] == [2, 3]
    keys = object_keys(s3_server, s3_bucket)
    assert "run/latest" in keys and not any(".ucp-saving" in k for k in keys)

    # a damaged local copy: the same step comes from the remote tier
    data = tmp_path / "ckpt" / "step-00000003" / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    m2 = ucp.CheckpointManager(tmp_path / "ckpt", keep_last=1, remote=remote, remote_keep_last=2)
    out = m2.load()
    assert m2.loaded_from == remote and m2.loaded_step == 3 and torch.equal(out["w"], state(3)["w"])
    # the node's disk is gone: everything that was replicated is still there
    shutil.rmtree(tmp_path / "ckpt")
    out = m2.load()
    assert m2.loaded_from == remote and m2.loaded_step == 3 and out["step"] == 3
    assert torch.equal(m2.load(2)["w"], state(2)["w"]) and m2.loaded_from == remote
    m2.close()


def test_async_tiered_saves_replicate_after_the_local_commit(s3_server, s3_bucket, tmp_path):  # noqa: F811
    remote = f"s3://{s3_bucket}/arun"
    with ucp.CheckpointManager(tmp_path / "c", async_save=True, remote=remote) as m:
        handles = [m.save(state(s), s) for s in (10, 20)]
        for h in handles:
            h.result()  # the local commit: what training waits for
        assert os.path.isdir(m.path(20))
        m.wait()  # and the replication
        assert [i.step for i in m.remote_manager().list()] == [10, 20]
        assert torch.equal(ucp.load(f"{remote}/step-00000020")["w"], state(20)["w"])
