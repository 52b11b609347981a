"""Object-store transfers through a fault-injecting proxy: dropped connections, 503 SlowDown and slow
answers are survived by retries; an exhausted retry budget fails naming the object and leaves no
multipart upload behind."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from fault_proxy import FaultProxy
from s3_endpoint import multipart_uploads, object_keys, s3_bucket, s3_server  # noqa: F401

import ucp
from ucp.errors import StorageError

KINDS = ("503", "drop", "drop-mid", "slow")


@pytest.fixture()
def proxy(s3_server, s3_bucket, monkeypatch) -> Iterator[FaultProxy]:  # noqa: F811
    port = int(s3_server.url.rsplit(":", 1)[1])
    p = FaultProxy(port, slow_seconds=0.2).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    yield p
    p.stop()


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(3, 1024, 1024, generator=g), "v": torch.randn(1000, generator=g).to(torch.float16)}


OPTS = {"part_size": "5MiB", "concurrency": 3, "backoff_initial": 0.01, "backoff_max": 0.1, "max_retries": 6}


def test_faults_are_survived_by_retries(s3_server, s3_bucket, proxy):  # noqa: F811
    # every third request fails, cycling through the kinds of fault
    proxy.plan = lambda method, target, n: KINDS[(n // 3) % len(KINDS)] if n % 3 == 2 else None
    sd = state()
    url = f"s3://{s3_bucket}/ck"
    ucp.save(sd, url, storage_options=OPTS)
    out = ucp.load(url, storage_options=OPTS)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["v"].view(torch.int16), sd["v"].view(torch.int16))
    assert ucp.verify(url, storage_options=OPTS).ok
    seen = {f for f, _, _ in proxy.faults}
    assert seen == set(KINDS), proxy.faults
    assert any(m == "PUT" and "partNumber" in t for _, m, t in proxy.faults), "no upload part was hit"
    assert multipart_uploads(s3_server, s3_bucket) == []


def test_an_exhausted_retry_budget_names_the_object_and_leaves_no_upload(s3_server, s3_bucket, proxy):  # noqa: F811
    proxy.plan = lambda method, target, n: "503" if method == "PUT" and "partNumber=2" in target else None
    url = f"s3://{s3_bucket}/ck"
    opts = {**OPTS, "max_retries": 2}
    with pytest.raises(StorageError, match=rf"uploading s3://{s3_bucket}/ck/rank-00000.safetensors failed"):
        ucp.save(state(), url, storage_options=opts)
    assert len(proxy.faults) == 3  # the first try and two retries
    assert multipart_uploads(s3_server, s3_bucket) == []
    assert object_keys(s3_server, s3_bucket) == []  # nothing of the failed save is left
    with pytest.raises(ucp.NotACheckpointError):
        ucp.load(url)


def test_reads_whose_retries_run_out_name_the_object(s3_server, s3_bucket, proxy):  # noqa: F811
    url = f"s3://{s3_bucket}/ck"
    ucp.save(state(), url, storage_options=OPTS)
    proxy.plan = lambda method, target, n: "drop" if method == "GET" and "rank-00000" in target else None
    with pytest.raises(StorageError, match=rf"reading s3://{s3_bucket}/ck/rank-00000.safetensors failed"):
        ucp.load(url, storage_options={**OPTS, "max_retries": 1})


def test_a_replication_survives_a_fault_and_one_out_of_retries_names_the_object(  # noqa: F811
    s3_server,  # noqa: F811
    s3_bucket,  # noqa: F811
    proxy,
    tmp_path,
):
    """A tiered manager's copy of a committed local checkpoint (the client library reads the file itself):
    a 503 on a part is retried; retries run out -> the error names the object, no upload or manifest is left."""
    from ucp.replicate import replicate

    local, remote = tmp_path / "step-00000001", f"s3://{s3_bucket}/run"
    sd = state()
    ucp.save(sd, local, step=1)
    hits: list[str] = []

    def once(method: str, target: str, n: int) -> str | None:  # the first try of part 2 fails
        if "partNumber=2" not in target:
            return None
        hits.append(target)
        return "503" if len(hits) == 1 else None

    proxy.plan = once
    replicate(str(local), remote, "step-00000001", OPTS)
    assert len(hits) == 2  # the part failed once, then went through
    assert torch.equal(ucp.load(f"{remote}/step-00000001", storage_options=OPTS)["w"], sd["w"])
    proxy.plan = lambda method, target, n: "503" if method == "PUT" and "partNumber=2" in target else None
    with pytest.raises(StorageError, match=rf"uploading s3://{s3_bucket}/run/step-00000002/rank-00000.safetensors"):
        replicate(str(local), remote, "step-00000002", {**OPTS, "max_retries": 1})
    assert multipart_uploads(s3_server, s3_bucket) == []
    assert not [k for k in object_keys(s3_server, s3_bucket, "run/step-00000002/")]
