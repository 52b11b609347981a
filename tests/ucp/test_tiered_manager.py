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


def test_node_local_tier_replicates_each_ranks_files_and_commits_after_the_markers(s3_server, s3_bucket, tmp_path):  # noqa: F811
    remote = f"s3://{s3_bucket}/nl"
    with ucp.CheckpointManager(tmp_path / "n", keep_last=1, remote=remote, node_local=True, remote_keep_last=2) as m:
        for step in (1, 2, 3):
            m.save(state(step), step)
        m.wait()
        assert [i.step for i in m.list()] == [3]  # local retention, after replication
    keys = object_keys(s3_server, s3_bucket, "nl/")
    assert keys == [
        "nl/latest",
        "nl/step-00000002/manifest.json",
        "nl/step-00000002/rank-00000.safetensors",
        "nl/step-00000003/manifest.json",
        "nl/step-00000003/rank-00000.safetensors",
    ]  # the markers went with the commit
    shutil.rmtree(tmp_path / "n")
    m2 = ucp.CheckpointManager(tmp_path / "n", remote=remote, node_local=True)
    out = m2.load()
    assert m2.loaded_from == remote and m2.loaded_step == 3 and torch.equal(out["w"], state(3)["w"])
    assert m2.loaded_location() == (f"{remote}/step-00000003", None)
    m2.close()


def test_node_local_tier_refuses_a_missing_remote(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="node_local=True is for a tiered manager"):
        ucp.CheckpointManager(tmp_path / "b", node_local=True)


def test_rank_0_does_not_commit_before_every_rank_reported(s3_server, s3_bucket, tmp_path):  # noqa: F811
    """A rank whose marker never arrives: rank 0 gives up naming it, and the step stays uncommitted."""
    from ucp.format.manifest import FileInfo, parse_manifest
    from ucp.tiered import replicate_rank, save_id

    local = tmp_path / "step-00000007"
    ucp.save(state(7), local, step=7)
    manifest = parse_manifest((local / "manifest.json").read_bytes(), source="test")
    # as if a second rank had written a file of its own: the manifest says rank 1 owns it
    files = {**manifest.files, "rank-00001.safetensors": FileInfo(rank=1, size=8)}
    topology = manifest.topology.model_copy(update={"world_size": 2})
    (local / "manifest.json").write_bytes(manifest.model_copy(update={"files": files, "topology": topology}).to_json())
    remote = f"s3://{s3_bucket}/wait"
    import pytest

    from ucp.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not report their uploads within 0 s; not committed"):
        replicate_rank(str(local), remote, "step-00000007", 0, timeout=0.2)
    keys = object_keys(s3_server, s3_bucket, "wait/")
    assert keys == ["wait/step-00000007/.ucp-replicated-rank-00000", "wait/step-00000007/rank-00000.safetensors"]
    # an earlier attempt at this step left rank 1's marker, data of the right size and a failure: none is
    # this save's (another manifest's id), so rank 0 still waits for rank 1 and commits nothing
    client, prefix = s3_server.client(), "wait/step-00000007/"
    client.put_object(Bucket=s3_bucket, Key=prefix + "rank-00001.safetensors", Body=b"x" * 8)
    client.put_object(Bucket=s3_bucket, Key=prefix + ".ucp-replicated-rank-00001", Body=b"0badc0de")
    client.put_object(Bucket=s3_bucket, Key=prefix + ".ucp-failed-rank-00001", Body=b"0badc0de\nold failure")
    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not report their uploads"):
        replicate_rank(str(local), remote, "step-00000007", 0, timeout=0.3)
    # rank 1 reports a failed upload of this save: rank 0 stops waiting at once, naming it and its error
    ident = save_id(parse_manifest((local / "manifest.json").read_bytes(), source="test"))
    client.put_object(
        Bucket=s3_bucket, Key=prefix + ".ucp-failed-rank-00001", Body=ident + b"\nStorageError: throttled"
    )
    with pytest.raises(CheckpointError, match=r"rank 1 failed to upload its files \(StorageError: throttled\)"):
        replicate_rank(str(local), remote, "step-00000007", 0, timeout=60)
    assert "wait/step-00000007/manifest.json" not in object_keys(s3_server, s3_bucket, "wait/")


def test_local_retention_after_a_replication_keeps_a_newer_step_not_yet_submitted(tmp_path):
    """Step 3 committed locally, its save not yet returned (so neither submitted nor named by ``latest``)
    when step 2's replication finishes: the retention that follows must not delete it."""
    from ucp.manager import write_latest

    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        ucp.save(state(step), root / f"step-{step:08d}", step=step)
    write_latest(root, 2, "step-00000002")
    m = ucp.CheckpointManager(root, keep_last=1, remote="s3://bucket/run")
    m._retire_local("step-00000002", set())  # what the Replicator calls after replicating step 2
    m.close()
    assert [i.step for i in m.list()] == [2, 3]
