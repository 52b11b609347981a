"""A tiered manager's failed replication, forced through the fault proxy in front of the loopback S3 server:
nothing stays under the failed step's remote prefix (no objects, no multipart upload where the abort could
reach the store), the failure is reported (``replicator.failed``, ``wait()`` raising it), ``latest`` never
names the failed step, and the next step replicates. When the store was down, the prefix is cleaned once
it is back, after the next step commits."""

from __future__ import annotations

import json
from typing import Iterator

import pytest
import torch
from fault_proxy import FaultProxy
from s3_endpoint import multipart_uploads, object_keys, s3_bucket, s3_server  # noqa: F401

import ucp
from ucp.errors import StorageError

OPTS = {"part_size": "5MiB", "backoff_initial": 0.01, "backoff_max": 0.05, "max_retries": 2}


def state(step: int) -> dict:
    return {"w": torch.full((3, 1024, 1024), float(step)), "step": step}  # 12 MiB: a multipart upload


@pytest.fixture()
def proxy(s3_server, s3_bucket, monkeypatch) -> Iterator[FaultProxy]:  # noqa: F811
    p = FaultProxy(int(s3_server.url.rsplit(":", 1)[1])).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    yield p
    p.stop()


def test_an_exhausted_retry_budget_leaves_nothing_and_the_next_step_replicates(
    s3_server,  # noqa: F811
    s3_bucket,  # noqa: F811
    proxy,
    tmp_path,
):
    remote = f"s3://{s3_bucket}/run"
    with ucp.CheckpointManager(tmp_path / "c", remote=remote, remote_storage_options=OPTS) as m:
        m.save(state(1), 1)
        m.wait()
        proxy.plan = lambda method, target, n: "503" if method == "PUT" and "partNumber=2" in target else None
        m.save(state(2), 2)
        with pytest.raises(StorageError, match=rf"s3://{s3_bucket}/run/step-00000002/rank-00000.safetensors"):
            m.wait()
        assert list(m.replicator.failed) == ["step-00000002"] and "StorageError" in m.replicator.failed["step-00000002"]
        assert object_keys(s3_server, s3_bucket, "run/step-00000002/") == []
        assert multipart_uploads(s3_server, s3_bucket) == []
        assert m.remote_manager().latest() == 1 and m.remote_manager().load()["step"] == 1
        assert m.list()[-1].step == 2  # the local checkpoint stays

        proxy.plan = lambda method, target, n: None
        m.save(state(3), 3)
        m.wait()
        assert m.replicator.failed == {"step-00000002": m.replicator.failed["step-00000002"]}
        assert [(i.step, i.status) for i in m.remote_manager().list()] == [(1, "complete"), (3, "complete")]
        assert m.remote_manager().latest() == 3 and m.remote_manager().load()["step"] == 3

        # step 3 saved again fails to replicate: its old remote copy went first, so ``latest`` (the object
        # itself, not just what a resume picks) goes back to step 1 rather than name a partial prefix
        proxy.plan = lambda method, target, n: "503" if method == "PUT" and "partNumber=2" in target else None
        m.save(state(3), 3)
        with pytest.raises(StorageError):
            m.wait()
        assert object_keys(s3_server, s3_bucket, "run/step-00000003/") == []
        body = s3_server.client().get_object(Bucket=s3_bucket, Key="run/latest")["Body"].read()
        assert json.loads(body) == {"step": 1, "name": "step-00000001"}


def test_a_store_down_mid_upload_is_cleaned_once_it_is_back(s3_server, s3_bucket, proxy, tmp_path):  # noqa: F811
    down = {"on": False}

    def plan(method: str, target: str, n: int) -> str | None:
        if "partNumber=2" in target:
            down["on"] = True  # from the second part on, every request fails: the abort and the clean-up too
        return "drop" if down["on"] else None

    proxy.plan = plan
    remote = f"s3://{s3_bucket}/run"
    with ucp.CheckpointManager(tmp_path / "c", remote=remote, remote_storage_options=OPTS) as m:
        m.save(state(1), 1)
        with pytest.raises(StorageError):
            m.wait()
        assert list(m.replicator.failed) == ["step-00000001"]
        left = object_keys(s3_server, s3_bucket, "run/step-00000001/")
        assert left, "the store being down, nothing could be removed yet"

        down["on"] = False
        proxy.plan = lambda method, target, n: None
        m.save(state(2), 2)
        m.wait()
        assert object_keys(s3_server, s3_bucket, "run/step-00000001/") == []
        assert [(i.step, i.status) for i in m.remote_manager().list()] == [(2, "complete")]
        assert m.remote_manager().latest() == 2 and m.remote_manager().load()["step"] == 2


def test_node_local_rank_0_discards_a_step_another_rank_failed(s3_server, s3_bucket, tmp_path):  # noqa: F811
    """Rank 1 reports a failed upload: rank 0's replicator discards the step's prefix (its own file, its
    marker, rank 1's report); a file rank 1 still had in flight lands later and goes once the next step
    commits."""
    from ucp.errors import CheckpointError
    from ucp.format.manifest import FileInfo, parse_manifest
    from ucp.replicate import Replicator
    from ucp.tiered import failed_name, save_id

    root = tmp_path / "n"
    local = root / "step-00000007"
    ucp.save({"w": torch.ones(1000)}, local, step=7)
    manifest = parse_manifest((local / "manifest.json").read_bytes(), source="test")
    files = {**manifest.files, "rank-00001.safetensors": FileInfo(rank=1, size=8)}
    topology = manifest.topology.model_copy(update={"world_size": 2})
    (local / "manifest.json").write_bytes(manifest.model_copy(update={"files": files, "topology": topology}).to_json())
    ident = save_id(parse_manifest((local / "manifest.json").read_bytes(), source="test"))
    client, prefix = s3_server.client(), "nl/step-00000007/"
    client.put_object(Bucket=s3_bucket, Key=prefix + failed_name(1), Body=ident + b"\nStorageError: throttled")

    r = Replicator(str(root), f"s3://{s3_bucket}/nl", remote_keep_last=None, storage_options=None, rank=0, timeout=30)
    try:
        r.submit(7, "step-00000007")
        with pytest.raises(CheckpointError, match=r"rank 1 failed to upload its files"):
            r.wait()
        assert list(r.failed) == ["step-00000007"] and object_keys(s3_server, s3_bucket, prefix) == []
        client.put_object(Bucket=s3_bucket, Key=prefix + "rank-00001.safetensors", Body=b"x" * 8)  # rank 1, late

        ucp.save({"w": torch.ones(1000)}, root / "step-00000008", step=8)
        r.submit(8, "step-00000008")
        r.wait()
        assert object_keys(s3_server, s3_bucket, prefix) == []
        assert object_keys(s3_server, s3_bucket, "nl/step-00000008/") == [
            "nl/step-00000008/manifest.json",
            "nl/step-00000008/rank-00000.safetensors",
        ]
        assert ucp.CheckpointManager(f"s3://{s3_bucket}/nl").latest() == 8
    finally:
        r.close()
