"""Sharded saves loaded into other shardings, in place, reading only the bytes needed.

Ranks are simulated by threads (tests/support/ucp_helpers.run_ranks); real processes are in
test_ucp_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from ucp_helpers import random_tensor, same_bytes, save_ranks

import ucp
import ucp.loading.partial as partial_mod
from ucp.store.storage import LocalStorage

W = random_tensor(torch.float32, (8, 6), seed=1)  # saved as 2 row shards
V = random_tensor(torch.bfloat16, (6, 8), seed=2)  # saved as 2 column shards
F = random_tensor(torch.int32, (5, 7), seed=3)  # saved as 2 uneven flat shards
Z = random_tensor(torch.float16, (3, 4, 5), seed=4)  # saved as 3 flat shards (ZeRO)
R = random_tensor(torch.float64, (4,), seed=5)  # replicated


def rank_state(rank: int, world: int = 2) -> dict:
    rows = 8 // world
    cols = 8 // world
    cut = [0, 17, 35]
    zcut = [0, 23, 60]
    return {
        "w": ucp.ShardedTensor(W[rank * rows : (rank + 1) * rows], (8, 6), (rank * rows, 0)),
        "v": ucp.ShardedTensor(V[:, rank * cols : (rank + 1) * cols], (6, 8), (0, rank * cols)),
        "f": ucp.FlatShard(F.reshape(-1)[cut[rank] : cut[rank + 1]], (5, 7), cut[rank]),
        "opt": {
            0: {
                "z": ucp.FlatShard(Z.reshape(-1)[zcut[rank] : zcut[rank + 1]], (3, 4, 5), zcut[rank]),
                "z2": ucp.FlatShard(Z.reshape(-1), (3, 4, 5), 0, replica_id=rank),
            },
            "step": 10,
        },
        "r": R.clone(),
        "lr": 0.5,
    }


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    path = tmp_path_factory.mktemp("into") / "ck"
    # "opt.0.z": 2 flat pieces; "opt.0.z2": the whole flat tensor on both ranks, replica 0 writes it
    save_ranks(path, [rank_state(0), rank_state(1)], step=3, mesh={"dp": 2})
    return path


def test_manifest_layout(ck):
    m = ucp.read_manifest(ck)
    assert m.topology.world_size == 2 and m.topology.mesh == {"dp": 2} and m.step == 3
    assert len(m.tensors["w"].pieces) == 2 and m.tensors["w"].pieces[1].box.offsets == [4, 0]
    assert len(m.tensors["r"].pieces) == 1  # replicated: written once
    assert len(m.tensors["opt.0.z2"].pieces) == 1  # replica_id 1 not written
    assert sorted(m.files) == ["rank-00000.safetensors", "rank-00001.safetensors"]


def test_whole_load_assembles_full_tensors(ck):
    out = ucp.load(ck)
    assert same_bytes(out["w"], W) and same_bytes(out["v"], V) and same_bytes(out["f"], F)
    assert out["opt"]["step"] == 10 and out["lr"] == 0.5 and same_bytes(out["r"], R)
    assert same_bytes(out["opt"][0]["z2"], Z) and same_bytes(out["opt"][0]["z"], Z)


def test_into_full_tensors_with_cast(ck):
    into = {
        "w": torch.zeros(8, 6, dtype=torch.bfloat16),
        "v": torch.zeros(6, 8),
        "f": torch.zeros(5, 7, dtype=torch.int64),
    }
    out = ucp.load(ck, into=into)
    assert out is into
    assert same_bytes(into["w"], W.to(torch.bfloat16))
    assert same_bytes(into["v"], V.float())
    assert same_bytes(into["f"], F.long())


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("verify", [True, False])
def test_into_other_shardings(ck, world, verify):
    for rank in range(world):
        # w (saved as rows) -> column shards; v (saved as columns) -> row shards (uneven for world 3/4)
        wc = [0, 2, 4, 6][:world] + [6]
        wc = sorted(set([round(i * 6 / world) for i in range(world)] + [6]))
        w_lo, w_hi = wc[rank], wc[rank + 1]
        vr = sorted(set([round(i * 6 / world) for i in range(world)] + [6]))
        v_lo, v_hi = vr[rank], vr[rank + 1]
        n = 35
        f_lo, f_hi = round(rank * n / world), round((rank + 1) * n / world)
        into = {
            "w": ucp.ShardedTensor(torch.zeros(8, w_hi - w_lo), (8, 6), (0, w_lo)),
            "v": ucp.ShardedTensor(torch.zeros(v_hi - v_lo, 8, dtype=torch.bfloat16), (6, 8), (v_lo, 0)),
            "f": ucp.FlatShard(torch.zeros(f_hi - f_lo, dtype=torch.int32), (5, 7), f_lo),
            "opt": {
                0: {"z": ucp.ShardedTensor(torch.zeros(3, 4, 1, dtype=torch.float16), (3, 4, 5), (0, 0, rank % 5))}
            },
            "lr": None,
        }
        ucp.load(ck, into=into, verify=verify, strict=False)  # a subset of the tensors
        assert same_bytes(into["w"].local, W[:, w_lo:w_hi].contiguous())
        assert same_bytes(into["v"].local, V[v_lo:v_hi].contiguous())
        assert same_bytes(into["f"].local, F.reshape(-1)[f_lo:f_hi].contiguous())
        assert same_bytes(into["opt"][0]["z"].local, Z[:, :, rank % 5 : rank % 5 + 1].contiguous())
        assert into["lr"] == 0.5


def test_into_non_contiguous_targets(ck):
    big = torch.zeros(6, 8)
    target = big.t()  # (8, 6) view with strides (1, 8)
    ucp.load(ck, into={"w": target})
    assert same_bytes(big.t().contiguous(), W)
    buf = torch.zeros(70, dtype=torch.int32)
    flat_view = buf[::2]  # 35 elements, stride 2
    ucp.load(ck, into={"f": ucp.FlatShard(flat_view, (5, 7), 0)})
    assert same_bytes(buf[::2].contiguous(), F.reshape(-1)) and torch.all(buf[1::2] == 0)


def test_same_layout_reads_directly_into_targets(ck, monkeypatch):
    def no_staging(*a, **k):
        raise AssertionError("staged read used for an identical layout")

    monkeypatch.setattr(partial_mod, "_finish_staged", no_staging)
    target = ucp.ShardedTensor(torch.zeros(4, 6), (8, 6), (4, 0))  # exactly rank 1's piece
    ucp.load(ck, into={"w": target, "r": torch.zeros(4, dtype=torch.float64)})
    assert same_bytes(target.local, W[4:])


def test_partial_reads_fetch_only_needed_bytes(tmp_path, monkeypatch):
    big = random_tensor(torch.float32, (512, 1024), seed=9)  # 2 MiB as 2 row shards of 1 MiB
    save_ranks(
        tmp_path / "ck",
        [{"w": ucp.ShardedTensor(big[r * 256 : (r + 1) * 256], (512, 1024), (r * 256, 0))} for r in range(2)],
    )
    seen = []
    orig = LocalStorage.read_ranges

    def spy(self, rel, ranges):
        ranges = list(ranges)
        seen.extend((rel, off, dest.nbytes) for off, dest in ranges)
        return orig(self, rel, ranges)

    monkeypatch.setattr(LocalStorage, "read_ranges", spy)
    one_row = ucp.ShardedTensor(torch.zeros(1, 1024), (512, 1024), (300, 0))
    ucp.load(tmp_path / "ck", into={"w": one_row}, verify=False)
    assert same_bytes(one_row.local, big[300:301].contiguous())
    assert len(seen) == 1 and seen[0][0].endswith("rank-00001.safetensors")
    assert 4096 <= seen[0][2] <= 3 * 4096  # the row (4 KiB), rounded out to aligned blocks
    seen.clear()
    col = ucp.ShardedTensor(torch.zeros(512, 1), (512, 1024), (0, 7))
    ucp.load(tmp_path / "ck", into={"w": col}, verify=True)  # verifying reads whole pieces
    assert same_bytes(col.local, big[:, 7:8].contiguous())
    assert sum(n for _, _, n in seen) >= 2 * (1 << 20)


def test_into_structure_and_values(ck):
    into = {
        "opt": {0: {"z": torch.zeros(3, 4, 5, dtype=torch.float16)}, "step": 0},
        "lr": 1.0,
        "r": torch.zeros(4, dtype=torch.float64),
    }
    ucp.load(ck, into=into, strict=False)
    assert into["opt"]["step"] == 10 and into["lr"] == 0.5
    assert same_bytes(into["opt"][0]["z"], Z)
    # a plain value in ``into`` where the checkpoint has a tensor: replaced by the full tensor
    into2 = {"w": None, "opt": {0: {"z2": "placeholder"}}}
    ucp.load(ck, into=into2, strict=False)
    assert same_bytes(into2["w"], W) and same_bytes(into2["opt"][0]["z2"], Z)


@pytest.mark.parametrize(
    "into, match",
    [
        (
            {"missing": torch.zeros(1)},
            r"missing from the checkpoint \(in into= but not saved\): state_dict\['missing'\]",
        ),
        ({"w": torch.zeros(8, 5)}, r"'w'.*shape is \[8, 6\], the target's \[8, 5\]"),
        ({"w": ucp.ShardedTensor(torch.zeros(2, 2), (4, 4), (0, 0))}, "shape"),
        ({"lr": torch.zeros(1)}, "holds the value 0.5 here, not a tensor"),
        ({"w": {"x": 1}}, "holds a tensor here, not a dict"),
        ({"opt": {"0": {}}}, r"missing from the checkpoint .*: state_dict\['opt'\]\['0'\]"),  # int key 0 is not str "0"
        ({"opt": [1]}, "not a list"),
    ],
)
def test_into_mismatch_errors(ck, into, match):
    with pytest.raises(ucp.LayoutMismatchError, match=match):
        ucp.load(ck, into=into)


def test_optimizer_state_dict_into_existing_optimizer(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ucp.save({"optim": opt.state_dict()}, tmp_path / "ck")
    fresh = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    fresh.step()
    target = {"optim": fresh.state_dict()}
    ucp.load(tmp_path / "ck", into=target)
    for k in (0, 1):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bytes(target["optim"]["state"][k][name], opt.state_dict()["state"][k][name])


@pytest.mark.parametrize("verify", [True, False])
def test_many_small_batches(ck, monkeypatch, verify):
    """Tiny batches: every read goes through the read-ahead rotation of staging buffers."""
    monkeypatch.setattr(partial_mod, "BATCH_BYTES", 1)
    into = {
        "w": ucp.ShardedTensor(torch.zeros(8, 3), (8, 6), (0, 3)),
        "v": torch.zeros(6, 8, dtype=torch.bfloat16),
        "f": ucp.FlatShard(torch.zeros(20, dtype=torch.int32), (5, 7), 10),
        "r": torch.zeros(4, dtype=torch.float64),
        "opt": {0: {"z": torch.zeros(3, 4, 5, dtype=torch.float16), "z2": torch.zeros(3, 4, 5)}},
    }
    ucp.load(ck, into=into, verify=verify, strict=False)
    assert same_bytes(into["w"].local, W[:, 3:].contiguous()) and same_bytes(into["v"], V)
    assert same_bytes(into["f"].local, F.reshape(-1)[10:30].contiguous()) and same_bytes(into["r"], R)
    assert same_bytes(into["opt"][0]["z"], Z) and same_bytes(into["opt"][0]["z2"], Z.float())
