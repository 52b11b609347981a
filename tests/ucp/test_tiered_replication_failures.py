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
