"""Multi-region leaves (ucp.Shards): one rank holding several regions of one global tensor.

Tensor parallelism makes them: a rank's fused-QKV shard is its rows of q, k and v (3 boxes).
Ranks are simulated by threads (tests/support/ucp_helpers.run_ranks).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from ucp_helpers import random_tensor, run_ranks, same_bytes, save_ranks

import ucp
from ucp import AsyncSaver

H, C = 4, 6  # rows of each of q, k, v; columns
QKV = random_tensor(torch.float32, (3 * H, C), seed=11)  # global fused [q; k; v]
FL = random_tensor(torch.bfloat16, (5, 4), seed=12)  # saved as flat ranges


def qkv_shards(rank: int, world: int, local: torch.Tensor | None = None) -> ucp.Shards:
    """Rank ``rank``'s [q_r; k_r; v_r] as 3 ShardedTensor views of one local tensor."""
    h = H // world
    if local is None:
        local = torch.cat([QKV[j * H + rank * h : j * H + (rank + 1) * h] for j in range(3)])
    return ucp.Shards(
        [ucp.ShardedTensor(local[j * h : (j + 1) * h], (3 * H, C), (j * H + rank * h, 0)) for j in range(3)]
    )


def flat_shards(rank: int) -> ucp.Shards:
    """Rank 0 holds flat ranges [0, 3) and [10, 14) plus the box of row 4; rank 1 the rest (rows 0-3 minus those)."""
    flat = FL.reshape(-1)
    if rank == 0:
        return ucp.Shards(
            [
                ucp.FlatShard(flat[0:3].clone(), (5, 4), 0),
                ucp.FlatShard(flat[10:14].clone(), (5, 4), 10),
                ucp.ShardedTensor(FL[4:5].clone(), (5, 4), (4, 0)),
            ]
        )
    return ucp.Shards([ucp.FlatShard(flat[3:10].clone(), (5, 4), 3), ucp.FlatShard(flat[14:16].clone(), (5, 4), 14)])


def rank_state(rank: int) -> dict:
    return {"qkv": qkv_shards(rank, 2), "fl": flat_shards(rank), "rep": torch.arange(3), "step": 7}


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    path = tmp_path_factory.mktemp("shards") / "ck"
    save_ranks(path, [rank_state(0), rank_state(1)], step=7)
    return path


def test_full_load_is_bit_exact(ck):
    out = ucp.load(ck)
    assert same_bytes(out["qkv"], QKV) and same_bytes(out["fl"], FL)
    assert torch.equal(out["rep"], torch.arange(3)) and out["step"] == 7


def test_manifest_and_safetensors_entries(ck):
    m = ucp.read_manifest(ck)
    pieces = m.tensors["qkv"].pieces
    assert len(pieces) == 6 and len(m.tensors["fl"].pieces) == 5
    for f in m.files:
        mine = [p for p in pieces if p.file == f]
        assert [p.entry for p in mine] == [None, "qkv#1", "qkv#2"]
        with safe_open(str(ck / f), framework="pt") as sf:
            keys = set(sf.keys())
            assert {"qkv", "qkv#1", "qkv#2"} <= keys
            for p, key in zip(mine, ["qkv", "qkv#1", "qkv#2"]):
                region = p.region()
                assert same_bytes(sf.get_tensor(key), QKV[region.slices()])
    with safe_open(str(ck / "rank-00000.safetensors"), framework="pt") as sf:
        assert {"fl", "fl#1", "fl#2"} <= set(sf.keys())
    raw = json.loads((ck / "manifest.json").read_text())
    assert "entry" not in raw["tensors"]["rep"]["pieces"][0]  # single pieces are written as before
    assert ucp.verify(ck).ok


def test_load_into_one_full_tensor(ck):
    into = {
        "qkv": torch.zeros(3 * H, C),
        "fl": torch.zeros(5, 4, dtype=torch.bfloat16),
        "rep": torch.zeros(3, dtype=torch.long),
        "step": 0,
    }
    ucp.load(ck, into=into)
    assert same_bytes(into["qkv"], QKV) and same_bytes(into["fl"], FL) and into["step"] == 7


def test_load_into_other_shards_layout(ck):
    # 4 ranks: each Shards' parts are views of one local tensor, filled in place
    for rank in range(4):
        local = torch.full((3 * (H // 4), C), -1.0)
        target = qkv_shards(rank, 4, local)
        into = {"qkv": target}
        ucp.load(ck, into=into)
        assert into["qkv"] is target
        want = torch.cat([QKV[j * H + rank : j * H + rank + 1] for j in range(3)])
        assert same_bytes(local, want)
    # a Shards of flat ranges and a box
    flat = torch.zeros(6, dtype=torch.bfloat16)
    box = torch.zeros(2, 4, dtype=torch.bfloat16)
    ucp.load(
        ck,
        into={
            "fl": ucp.Shards(
                [
                    ucp.FlatShard(flat[:3], (5, 4), 1),
                    ucp.FlatShard(flat[3:], (5, 4), 17),
                    ucp.ShardedTensor(box, (5, 4), (2, 0)),
                ]
            )
        },
    )
    f = FL.reshape(-1)
    assert same_bytes(flat, torch.cat([f[1:4], f[17:20]])) and same_bytes(box, FL[2:4])


def test_replicas_and_async_save(tmp_path):
    """Rank 1 holds q and v as replica 1 (not written) and k as its own; the async path writes the same."""

    def state(rank: int) -> dict:
        local = QKV.clone()
        parts = [
            ucp.ShardedTensor(local[j * H : (j + 1) * H], (3 * H, C), (j * H, 0), replica_id=int(rank != (j == 1)))
            for j in range(3)
        ]
        return {"qkv": ucp.Shards(parts)}

    def fn(group):
        with AsyncSaver() as saver:
            return saver.save(state(group.rank), tmp_path / "ck", process_group=group).result(timeout=60)

    run_ranks(2, fn)
    m = ucp.read_manifest(tmp_path / "ck")
    assert [(p.file, p.entry) for p in m.tensors["qkv"].pieces] == [
        ("rank-00000.safetensors", None),
        ("rank-00000.safetensors", "qkv#1"),
        ("rank-00001.safetensors", None),
    ]
    assert same_bytes(ucp.load(tmp_path / "ck")["qkv"], QKV) and ucp.verify(tmp_path / "ck").ok


def test_bad_shards_are_refused():
    with pytest.raises(ValueError, match="global_shape"):
        ucp.Shards(
            [ucp.ShardedTensor(torch.zeros(2, 3), (4, 3), (0, 0)), ucp.ShardedTensor(torch.zeros(2, 3), (6, 3), (2, 0))]
        )
    with pytest.raises(ValueError, match="dtype"):
        ucp.Shards([ucp.FlatShard(torch.zeros(2), (4,), 0), ucp.FlatShard(torch.zeros(2, dtype=torch.int32), (4,), 2)])
    with pytest.raises(ValueError):
        ucp.Shards([])


def _edit_manifest(src, dst, edit) -> None:
    import shutil

    shutil.copytree(src, dst)
    raw = json.loads((dst / "manifest.json").read_text())
    edit(raw)
    (dst / "manifest.json").write_text(json.dumps(raw))


def test_entry_naming_another_tensor_is_refused(ck, tmp_path):
    def other(raw):
        raw["tensors"]["qkv"]["pieces"][1]["entry"] = "fl#1"

    _edit_manifest(ck, tmp_path / "a", other)
    with pytest.raises(ucp.CheckpointError, match="entry"):
        ucp.load(tmp_path / "a")

    def duplicate(raw):
        raw["tensors"]["qkv"]["pieces"][2]["entry"] = "qkv#1"

    _edit_manifest(ck, tmp_path / "b", duplicate)
    with pytest.raises(ucp.CheckpointError, match="qkv#1"):
        ucp.load(tmp_path / "b")


def test_header_must_use_the_manifest_entries(ck, tmp_path):
    def swap(raw):  # entry names valid but not what the data file's header says
        ps = raw["tensors"]["qkv"]["pieces"]
        ps[1]["entry"], ps[2]["entry"] = "qkv#2", "qkv#1"

    _edit_manifest(ck, tmp_path / "c", swap)
    with pytest.raises(ucp.CheckpointError, match="header"):
        ucp.load(tmp_path / "c")


def test_generated_names_never_hold_the_entry_separator(tmp_path):
    ucp.save(
        {
            "a#1": torch.ones(2),
            "a": ucp.Shards([ucp.FlatShard(torch.zeros(1), (2,), 0), ucp.FlatShard(torch.ones(1), (2,), 1)]),
        },
        tmp_path / "ck",
    )
    m = ucp.read_manifest(tmp_path / "ck")
    assert sorted(m.tensors) == ["a", "a_1"]
    out = ucp.load(tmp_path / "ck")
    assert torch.equal(out["a#1"], torch.ones(2)) and torch.equal(out["a"], torch.tensor([0.0, 1.0]))


def test_check_replicas_compares_flat_shard_replicas(tmp_path):
    """ZeRO-style flat partitions held by two ranks (replica 0 and 1 of each): equal copies save, a copy
    that differs in one element fails the save naming the tensor and the flat range; off, it saves rank 0's."""
    w = random_tensor(torch.float32, (6, 5), seed=3)
    flat = w.reshape(-1)

    def states(drift: float) -> list[dict]:
        out = []
        for rank in (0, 1):
            mine = flat.clone()
            if rank == 1 and drift:
                mine.view(torch.int32)[17] ^= 1  # one bit of one element
            out.append(
                {
                    "w": ucp.Shards(
                        [
                            ucp.FlatShard(mine[:12].clone(), (6, 5), 0, replica_id=rank),
                            ucp.FlatShard(mine[12:].clone(), (6, 5), 12, replica_id=1 - rank),
                        ]
                    )
                }
            )
        return out

    save_ranks(tmp_path / "equal", states(0.0), check_replicas=True)
    assert same_bytes(ucp.load(tmp_path / "equal")["w"], w)
    with pytest.raises(
        ucp.CommitError,
        match=r"tensor 'w': rank 0's copy of elements .*\"start\":12,\"stop\":30.* "
        r"rank 1 wrote",
    ):
        save_ranks(tmp_path / "drift", states(1.0), check_replicas=True)
    assert not (tmp_path / "drift").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".drift")] == []
    save_ranks(tmp_path / "unchecked", states(1.0))  # the default: the writer's copy, no comparison
    got = ucp.load(tmp_path / "unchecked")["w"].reshape(-1)
    assert got.view(torch.int32)[17] == flat.view(torch.int32)[17] ^ 1


@pytest.mark.parametrize("snapshot", ["sync", "background"])
def test_check_replicas_through_the_async_saver_and_manager(tmp_path, snapshot):
    """The checksums are taken when save() is called; a drifted replica fails the handle, nothing committed."""
    w = random_tensor(torch.float32, (4, 8), seed=5)

    def state(rank: int, drift: float) -> dict:
        mine = w.clone()
        if rank == 1 and drift:
            mine.view(torch.int32)[0, 3] ^= 1  # one bit of one element
        return {
            "w": ucp.Shards(
                [
                    ucp.ShardedTensor(mine[:2].clone(), (4, 8), (0, 0), replica_id=rank),
                    ucp.ShardedTensor(mine[2:].clone(), (4, 8), (2, 0), replica_id=1 - rank),
                ]
            )
        }

    def fn(group):
        with AsyncSaver(snapshot=snapshot) as saver:
            saver.save(state(group.rank, 0.0), tmp_path / "ok", process_group=group, check_replicas=True).result(60)
            bad = saver.save(state(group.rank, 2.0), tmp_path / "bad", process_group=group, check_replicas=True)
            # rank 0 (the committer) names the tensor; the others learn that it did not commit, and why
            with pytest.raises(
                ucp.CommitError,
                match=r"tensor 'w': rank 1's copy of box"
                if group.rank == 0
                else r"rank 0 did not commit .*: .*tensor 'w': rank 1's copy of box",
            ):
                bad.result(timeout=60)

    run_ranks(2, fn)
    assert same_bytes(ucp.load(tmp_path / "ok")["w"], w)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_the_manager_passes_check_replicas_on(tmp_path, monkeypatch, async_save):
    import ucp.saving.sync_save as sync_save  # the manager imports the save at call time

    seen = []
    real_sync, real_async = sync_save.save, AsyncSaver.save
    monkeypatch.setattr(sync_save, "save", lambda *a, **k: (seen.append(k["check_replicas"]), real_sync(*a, **k))[1])
    monkeypatch.setattr(
        AsyncSaver, "save", lambda self, *a, **k: (seen.append(k["check_replicas"]), real_async(self, *a, **k))[1]
    )
    with ucp.CheckpointManager(tmp_path, async_save=async_save) as manager:
        manager.save({"x": torch.ones(3)}, 1, check_replicas=True)
        manager.save({"x": torch.ones(3)}, 2)
    assert seen == [True, False]
