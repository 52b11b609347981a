"""Checkpoints on a real S3 endpoint (moto's server on loopback): round trips, the in-place commit,
ranged reads, and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch
from s3_endpoint import multipart_uploads, object_keys, s3_bucket, s3_server  # noqa: F401

import ucp
from ucp.errors import NotACheckpointError, StorageError
from ucp.store.s3 import S3Options, S3Storage

SMALL = {"part_size": "5MiB", "concurrency": 4}  # several parts for a few-MiB file


def state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {"w": torch.randn(700, 3000, generator=g), "b": torch.randn(3000, generator=g).to(torch.bfloat16)},
        "ids": torch.arange(1000, dtype=torch.int64),
        "step": 12,
    }


def assert_same(a: dict, b: dict) -> None:
    for k in ("w", "b"):
        assert a["model"][k].dtype == b["model"][k].dtype
        assert torch.equal(a["model"][k].view(torch.uint8), b["model"][k].view(torch.uint8))
    assert torch.equal(a["ids"], b["ids"]) and a["step"] == b["step"]


def test_sync_and_async_round_trips_are_bit_exact_and_commit_by_manifest(s3_server, s3_bucket):  # noqa: F811
    sd = state()
    url = f"s3://{s3_bucket}/run/ck"
    ucp.save(sd, url, storage_options=SMALL)
    assert object_keys(s3_server, s3_bucket) == ["run/ck/manifest.json", "run/ck/rank-00000.safetensors"]
    assert_same(ucp.load(url, storage_options=SMALL), sd)
    handle = ucp.async_save(sd, f"s3://{s3_bucket}/run/ck2", storage_options=SMALL)
    handle.result()
    assert_same(ucp.load(f"s3://{s3_bucket}/run/ck2"), sd)
    assert ucp.verify(url).ok
    assert multipart_uploads(s3_server, s3_bucket) == []
    # replacing a checkpoint in place: still exactly one manifest and one data file
    sd["step"] = 13
    ucp.save(sd, url, storage_options=SMALL)
    assert ucp.load(url)["step"] == 13
    assert object_keys(s3_server, s3_bucket, "run/ck/") == ["run/ck/manifest.json", "run/ck/rank-00000.safetensors"]
    # a save that fails before writing leaves the checkpoint it would have replaced
    with pytest.raises(ucp.UnsupportedStateError):
        ucp.save({"z": torch.zeros(2, dtype=torch.complex128)}, url)
    assert ucp.load(url)["step"] == 13


def test_load_into_reads_only_the_ranges_it_needs(s3_bucket, monkeypatch):  # noqa: F811
    sd = state()
    url = f"s3://{s3_bucket}/ck"
    ucp.save(sd, url)
    manifest = ucp.load(url, into={"ids": torch.empty(1000, dtype=torch.int64)}, strict=False)
    read: list[tuple[int, int]] = []
    real = S3Storage._get_into_async

    async def spy(self, rel, parts, limit):
        read.append((parts[0][0], parts[-1][0] + parts[-1][1].nbytes - parts[0][0]))
        return await real(self, rel, parts, limit)

    monkeypatch.setattr(S3Storage, "_get_into_async", spy)
    target = {"ids": torch.empty(1000, dtype=torch.int64)}
    ucp.load(url, into=target, strict=False)
    assert torch.equal(target["ids"], sd["ids"])
    # the data file's 4 KiB header, then the 8000 bytes of "ids": not the 8 MiB of "model.w" beside them
    assert sorted(n for _, n in read) == [4096, 8000], read
    del manifest
    # a whole load: neighbouring tensors share requests (3 tensors, 8.4 MB, part size 16 MiB)
    read.clear()
    assert_same(ucp.load(url), sd)
    assert len(read) <= 3 and sum(n for _, n in read) < 8_500_000, read


def test_a_prefix_without_a_manifest_is_not_a_checkpoint(s3_server, s3_bucket):  # noqa: F811
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="half/rank-00000.safetensors", Body=b"x" * 100)
    with pytest.raises(NotACheckpointError, match=rf"s3://{s3_bucket}/half.*no manifest.json"):
        ucp.load(f"s3://{s3_bucket}/half")
    with pytest.raises(NotACheckpointError, match=rf"s3://{s3_bucket}/nothing does not exist"):
        ucp.load(f"s3://{s3_bucket}/nothing")
    # a save never replaces what is not a checkpoint
    with pytest.raises(ucp.CheckpointError, match="not a checkpoint"):
        ucp.save(state(), f"s3://{s3_bucket}/half")
    assert object_keys(s3_server, s3_bucket) == ["half/rank-00000.safetensors"]


def test_wrong_credentials_and_a_missing_bucket_name_the_url(s3_bucket, monkeypatch):  # noqa: F811
    url = f"s3://{s3_bucket}/ck"
    ucp.save(state(), url)
    with pytest.raises(StorageError, match=rf"s3://{s3_bucket}/ck/manifest.json: access denied"):
        ucp.load(url, storage_options={"secret": "wrong"})
    with pytest.raises(StorageError, match=rf"s3://{s3_bucket}/other.*access denied"):
        ucp.save(state(), f"s3://{s3_bucket}/other", storage_options={"secret": "wrong"})
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-x/ck.*bucket 'no-such-bucket-x' does not exist"):
        ucp.load("s3://no-such-bucket-x/ck")
    with pytest.raises(StorageError, match=r"bucket 'no-such-bucket-x' does not exist"):
        ucp.save(state(), "s3://no-such-bucket-x/ck")
    with pytest.raises(StorageError, match=r"bad storage options.*part_sise"):
        ucp.load(url, storage_options={"part_sise": 1})


def test_an_object_deleted_mid_load_is_a_clear_error(s3_server, s3_bucket, monkeypatch):  # noqa: F811
    url = f"s3://{s3_bucket}/ck"
    ucp.save(state(), url)
    real = S3Storage._get_into_async
    client = s3_server.client()

    async def delete_first(self, rel, parts, limit):
        client.delete_object(Bucket=s3_bucket, Key="ck/rank-00000.safetensors")
        return await real(self, rel, parts, limit)

    monkeypatch.setattr(S3Storage, "_get_into_async", delete_first)
    with pytest.raises(FileNotFoundError, match=rf"s3://{s3_bucket}/ck/rank-00000.safetensors: no such object"):
        ucp.load(url)


def test_an_aborted_upload_leaves_no_parts_and_no_object(s3_server, s3_bucket):  # noqa: F811
    storage = S3Storage(s3_bucket, "run", S3Options(part_size="5MiB", concurrency=2))
    writer = storage.open_writer("ck/rank-00000.safetensors", 12 << 20)
    data = memoryview(bytes(range(256)) * (6 << 12))  # 6 MiB: the first part is on its way
    writer.write(data, borrow=True)
    writer.abort()
    assert multipart_uploads(s3_server, s3_bucket) == []
    assert object_keys(s3_server, s3_bucket) == []
    storage.close()


def test_payloads_go_unsigned_over_https_or_when_asked_and_the_server_accepts_them(s3_server, s3_bucket):  # noqa: F811
    from ucp.store.s3 import make_store

    def unsigned(**kw: object) -> str:
        return make_store("b", S3Options.model_validate(kw)).config["unsigned_payload"]

    assert unsigned(endpoint_url="https://s3.example") == "true"  # as AWS's SDKs: TLS protects the bytes
    assert unsigned(endpoint_url="http://127.0.0.1:9000") == "false"
    assert unsigned(endpoint_url="https://s3.example", unsigned_payload=False) == "false"
    sd = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB: a multipart upload of 5 MiB parts
    url, opts = f"s3://{s3_bucket}/unsigned", {"unsigned_payload": True, "part_size": "5MiB"}
    ucp.save(sd, url, storage_options=opts)
    assert torch.equal(ucp.load(url, storage_options=opts)["w"], sd["w"])
