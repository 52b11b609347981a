"""Multi-rank save logic (ranks simulated by threads): what the commit accepts and refuses."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors import safe_open
from ucp_helpers import same_bytes, save_ranks

import ucp
from aio import AioError, FileWriter

FULL = torch.arange(32.0).reshape(8, 4)


def rows(rank: int, world: int = 2, **kw) -> ucp.ShardedTensor:
    n = 8 // world
    return ucp.ShardedTensor(FULL[rank * n : (rank + 1) * n], (8, 4), (rank * n, 0), **kw)


def test_rank_files_are_plain_safetensors_of_the_local_pieces(tmp_path):
    save_ranks(
        tmp_path / "ck",
        [{"w": rows(r), "f": ucp.FlatShard(FULL.reshape(-1)[r * 16 : (r + 1) * 16], (8, 4), r * 16)} for r in range(2)],
    )
    for r in range(2):
        with safe_open(tmp_path / "ck" / f"rank-0000{r}.safetensors", "pt") as f:
            assert same_bytes(f.get_tensor("w"), FULL[r * 4 : (r + 1) * 4].contiguous())
            assert same_bytes(f.get_tensor("f"), FULL.reshape(-1)[r * 16 : (r + 1) * 16].contiguous())
            assert f.metadata() == {"format": "ucp", "ucp_format_version": str(ucp.FORMAT_VERSION), "rank": str(r)}


def test_overlapping_replicas_are_refused(tmp_path):
    states = [{"w": ucp.ShardedTensor(FULL.clone(), (8, 4), (0, 0))} for _ in range(2)]  # both replica 0
    with pytest.raises(ucp.CommitError, match=r"'w'.*overlap.*replica_id 0"):
        save_ranks(tmp_path / "ck", states)
    assert os.listdir(tmp_path) == []


def test_ranks_disagreeing_on_a_tensor_are_refused(tmp_path):
    states = [{"w": rows(0)}, {"w": ucp.ShardedTensor(FULL[4:].double(), (8, 4), (4, 0))}]
    with pytest.raises(ucp.CommitError, match=r"'w': rank 0 holds it as F32 \[8, 4\], rank 1 as F64"):
        save_ranks(tmp_path / "ck", states)
    assert os.listdir(tmp_path) == []


def test_a_failing_writer_on_one_rank_fails_all_and_cleans_up(tmp_path, monkeypatch):
    orig = FileWriter.write

    def write(self, data):
        if "rank-00001" in self.path and self.size > 0:
            raise AioError(errno.ENOSPC, self.path, self.size, "simulated")
        return orig(self, data)

    monkeypatch.setattr(FileWriter, "write", write)
    ucp.save({"old": torch.ones(1)}, tmp_path / "ck")
    with pytest.raises((AioError, ucp.CommitError)) as info:
        save_ranks(tmp_path / "ck", [{"w": rows(r)} for r in range(2)])
    assert "rank-00001" in str(info.value) or "No space" in str(info.value)
    assert os.listdir(tmp_path) == ["ck"]
    assert same_bytes(ucp.load(tmp_path / "ck")["old"], torch.ones(1))


def test_mesh_and_step_arguments(tmp_path):
    with pytest.raises(ucp.UnsupportedStateError, match="mesh"):
        ucp.save({}, tmp_path / "a", mesh={"dp": 2})  # world size is 1
    with pytest.raises(ucp.UnsupportedStateError, match="step"):
        ucp.save({}, tmp_path / "a", step="7")
    m = ucp.save({}, tmp_path / "a", mesh={"dp": 1, "tp": 1}, step=0)
    assert m.topology.mesh == {"dp": 1, "tp": 1} and m.step == 0
    assert os.listdir(tmp_path) == ["a"]


def test_many_ranks_with_uneven_flat_shards(tmp_path):
    world = 8
    z = torch.randn(7, 13)
    cuts = [0, 1, 1, 20, 33, 50, 77, 90, 91]  # empty shards too
    states = [
        {"z": ucp.FlatShard(z.reshape(-1)[cuts[r] : cuts[r + 1]], (7, 13), cuts[r]), "rep": torch.ones(r % 1 + 2)}
        for r in range(world)
    ]
    save_ranks(tmp_path / "ck", states)
    m = ucp.read_manifest(tmp_path / "ck")
    assert len(m.tensors["z"].pieces) == 8 and len(m.tensors["rep"].pieces) == 1
    assert same_bytes(ucp.load(tmp_path / "ck")["z"], z)
