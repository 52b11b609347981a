"""fsspec storage (memory://, file://): the same format, validation and commit as local paths."""

from __future__ import annotations

import json
import os

import fsspec
import pytest
import torch
from ucp_helpers import assert_same_state, random_tensor, same_bytes, save_ranks

import ucp

SD = {
    "w": random_tensor(torch.float32, (33, 17), seed=1),
    "h": random_tensor(torch.bfloat16, (9,), seed=2),
    "opt": {0: {"m": random_tensor(torch.float32, (4,), seed=3)}, "lr": 0.1},
}


@pytest.fixture
def mem_url():
    fs = fsspec.filesystem("memory")
    root = f"/ucp-test-{os.getpid()}-{id(object())}"
    yield f"memory://{root}"
    try:
        fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass


def test_memory_round_trip_and_overwrite(mem_url):
    url = f"{mem_url}/ck"
    ucp.save(SD, url, step=5)
    assert_same_state(ucp.load(url), SD)
    fs = fsspec.filesystem("memory")
    root = mem_url.removeprefix("memory://")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/ck", detail=False)) == [
        "manifest.json",
        "rank-00000.safetensors",
    ]
    new = {"x": torch.arange(7)}
    ucp.save(new, url)
    assert_same_state(ucp.load(url), new)
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] == ["ck"]  # no temp or old dirs
    assert ucp.verify(url).ok


def test_memory_validation(mem_url):
    url = f"{mem_url}/ck"
    ucp.save(SD, url)
    fs = fsspec.filesystem("memory")
    path = f"{mem_url.removeprefix('memory://')}/ck/rank-00000.safetensors"
    data = bytearray(fs.cat_file(path))
    m = ucp.read_manifest(url)
    off = m.tensors["h"].pieces[0].offset
    data[off] ^= 1
    fs.pipe_file(path, bytes(data))
    with pytest.raises(ucp.CorruptCheckpointError, match=rf"'h'.*rank-00000.safetensors.*offset {off}"):
        ucp.load(url)
    assert not ucp.verify(url).ok
    fs.pipe_file(path, bytes(data[:-3]))
    with pytest.raises(ucp.CorruptCheckpointError, match="truncated"):
        ucp.load(url)
    fs.rm(path)
    with pytest.raises(ucp.MissingDataError):
        ucp.load(url)
    with pytest.raises(ucp.NotACheckpointError):
        ucp.load(f"{mem_url}/nothing")


def test_memory_sharded_and_into(mem_url):
    url = f"{mem_url}/ck"
    full = random_tensor(torch.float32, (8, 4), seed=7)
    save_ranks(url, [{"w": ucp.ShardedTensor(full[r * 4 : (r + 1) * 4], (8, 4), (r * 4, 0))} for r in range(2)])
    col = ucp.ShardedTensor(torch.zeros(8, 2), (8, 4), (0, 2))
    ucp.load(url, into={"w": col})
    assert same_bytes(col.local, full[:, 2:].contiguous())
    ucp.load(url, into={"w": col}, verify=False)
    assert same_bytes(ucp.load(url)["w"], full)


def test_file_url_matches_local_format(tmp_path):
    ucp.save(SD, f"file://{tmp_path}/viaurl")
    ucp.save(SD, tmp_path / "local")
    assert_same_state(ucp.load(f"file://{tmp_path}/viaurl"), SD)
    assert_same_state(ucp.load(tmp_path / "viaurl"), SD)  # fsspec-written, aio-read
    assert_same_state(ucp.load(f"file://{tmp_path}/local"), SD)  # aio-written, fsspec-read
    a = (tmp_path / "viaurl" / "rank-00000.safetensors").read_bytes()
    b = (tmp_path / "local" / "rank-00000.safetensors").read_bytes()
    assert a == b  # byte-identical data files
    ma = json.loads((tmp_path / "viaurl" / "manifest.json").read_text())
    mb = json.loads((tmp_path / "local" / "manifest.json").read_text())
    ma.pop("created"), mb.pop("created")
    assert ma == mb
    ucp.save({"y": torch.ones(2)}, f"file://{tmp_path}/viaurl")  # overwrite via fsspec
    assert sorted(os.listdir(tmp_path)) == ["local", "viaurl"]
    assert ucp.verify(f"file://{tmp_path}/viaurl").ok
