"""One rank of the multi-process tests (run by test_ucp_distributed.py as a subprocess).

usage: python ucp_dist_worker.py SCENARIO[,SCENARIO...] RANK WORLD INIT_FILE CKPT_DIR
Exits non-zero with a traceback on any failed check.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ucp_helpers import random_tensor, same_bytes  # noqa: E402

import ucp  # noqa: E402
from ucp.saving.plan import PLAN_CACHE  # noqa: E402

W = random_tensor(torch.float32, (8, 6), seed=11)  # 2 ranks: row shards
V = random_tensor(torch.bfloat16, (6, 8), seed=12)  # 2 ranks: column shards
F = random_tensor(torch.int64, (5, 7), seed=13)  # 2 ranks: flat shards, uneven
R = random_tensor(torch.float16, (3, 3), seed=14)  # replicated plain tensor
S = random_tensor(torch.int8, (10,), seed=15)  # ShardedTensor replicated through replica_id
M = random_tensor(torch.float32, (8, 8), seed=16)  # 4 ranks: tp column shards x dp replicas
Z = random_tensor(torch.float32, (6, 5), seed=17)  # 4 ranks: ZeRO flat shards over all ranks


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def state_2(rank: int) -> dict:
    cut = [0, 16, 35]
    return {
        "model": {
            "w": ucp.ShardedTensor(W[rank * 4 : (rank + 1) * 4], (8, 6), (rank * 4, 0)),
            "v": ucp.ShardedTensor(V[:, rank * 4 : (rank + 1) * 4], (6, 8), (0, rank * 4)),
            "r": R.clone(),
            "s": ucp.ShardedTensor(S.clone(), (10,), (0,), replica_id=rank),
        },
        "optim": {
            "state": {0: {"f": ucp.FlatShard(F.reshape(-1)[cut[rank] : cut[rank + 1]], (5, 7), cut[rank])}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        f"rank{rank}": {"seed": rank},
        "step": 100,
    }


def save2(rank: int, world: int, ck: str) -> None:
    PLAN_CACHE.clear()
    m = ucp.save(state_2(rank), f"{ck}/two", step=100, mesh={"dp": 2}, metadata={"who": "test"})
    check(m.step == 100 and m.topology.world_size == 2, "manifest returned on every rank")
    check(len(m.tensors["model.r"].pieces) == 1, "replicated plain tensor written once")
    check(len(m.tensors["model.s"].pieces) == 1, "replica_id 1 not written")
    check(len(m.tensors["model.w"].pieces) == 2 and len(m.tensors["optim.state.0.f"].pieces) == 2, "sharded pieces")
    check(sorted(m.files) == ["rank-00000.safetensors", "rank-00001.safetensors"], f"one file per rank: {m.files}")
    # a second save of the same layout reuses the plan
    ucp.save(state_2(rank), f"{ck}/two-again", step=101)
    check((PLAN_CACHE.hits, PLAN_CACHE.misses) == (1, 1), f"plan cache {PLAN_CACHE.hits}/{PLAN_CACHE.misses}")
    out = ucp.load(f"{ck}/two")
    check(same_bytes(out["model"]["w"], W) and same_bytes(out["model"]["v"], V), "w/v assembled")
    check(same_bytes(out["optim"]["state"][0]["f"], F) and same_bytes(out["model"]["r"], R), "f/r")
    check(same_bytes(out["model"]["s"], S), "s")
    check(out["rank0"] == {"seed": 0} and out["rank1"] == {"seed": 1} and out["step"] == 100, "merged plain values")
    check(out["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}], "param groups")


def bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    return (n * rank) // world, (n * (rank + 1)) // world


def load4(rank: int, world: int, ck: str) -> None:
    # the 2-rank checkpoint into a 4-rank layout: w as columns, v as rows, f as flat pieces and as boxes
    c0, c1 = bounds(6, world, rank)
    r0, r1 = bounds(6, world, rank)
    f0, f1 = bounds(35, world, rank)
    into: dict[str, Any] = {
        "model": {
            "w": ucp.ShardedTensor(torch.zeros(8, c1 - c0, dtype=torch.float64), (8, 6), (0, c0)),
            "v": ucp.ShardedTensor(torch.zeros(r1 - r0, 8, dtype=torch.bfloat16), (6, 8), (r0, 0)),
        },
        "optim": {"state": {0: {"f": ucp.FlatShard(torch.zeros(f1 - f0, dtype=torch.int64), (5, 7), f0)}}},
        "step": 0,
    }
    ucp.load(f"{ck}/two", into=into, strict=False, process_group=dist.group.WORLD)  # some of the tensors
    check(same_bytes(into["model"]["w"].local, W[:, c0:c1].double()), "w as columns (cast to f64)")
    check(same_bytes(into["model"]["v"].local, V[r0:r1].contiguous()), "v as rows")
    check(same_bytes(into["optim"]["state"][0]["f"].local, F.reshape(-1)[f0:f1].contiguous()), "f re-cut")
    check(into["step"] == 100, "plain value")
    box = {"optim": {"state": {0: {"f": ucp.ShardedTensor(torch.zeros(1, 7, dtype=torch.int64), (5, 7), (rank, 0))}}}}
    ucp.load(f"{ck}/two", into=box, strict=False, verify=False)
    check(same_bytes(box["optim"]["state"][0]["f"].local, F[rank : rank + 1].contiguous()), "flat stored -> box")

    # a 2x2 (dp x tp) save: M split in columns by tp and replicated over dp; Z flat over all 4 ranks
    dp, tp = divmod(rank, 2)
    z0, z1 = bounds(30, world, rank)
    state = {
        "m": ucp.ShardedTensor(M[:, tp * 4 : (tp + 1) * 4].clone(), (8, 8), (0, tp * 4), replica_id=dp),
        "z": ucp.FlatShard(Z.reshape(-1)[z0:z1].clone(), (6, 5), z0),
        "r": R.clone(),
        "p": [torch.full((2,), float(i)) for i in range(3)],  # plain tensors spread over ranks
    }
    m = ucp.save(state, f"{ck}/four", mesh={"dp": 2, "tp": 2})
    check(len(m.tensors["m"].pieces) == 2, "dp replicas written once")
    check(len(m.tensors["z"].pieces) == 4 and len(m.tensors["r"].pieces) == 1, "z/r pieces")
    writers = {m.tensors[f"p.{i}"].pieces[0].file for i in range(3)} | {m.tensors["r"].pieces[0].file}
    check(len(writers) == 4, f"replicated tensors spread over ranks: {writers}")
    out = ucp.load(f"{ck}/four")
    check(same_bytes(out["m"], M) and same_bytes(out["z"], Z) and same_bytes(out["r"], R), "4-rank whole load")


def fail_one(rank: int, world: int, ck: str) -> None:
    """Rank 1 holds something unsaveable: every rank must raise, nothing committed, no rank left waiting."""
    state: dict[str, Any] = {"w": ucp.ShardedTensor(W[rank * 4 : (rank + 1) * 4], (8, 6), (rank * 4, 0))}
    if rank == 1:
        state["bad"] = object()
    try:
        ucp.save(state, f"{ck}/failed")
    except ucp.CheckpointError as exc:
        check(("rank 1" in str(exc)) if rank == 0 else ("object" in str(exc)), f"error names the cause: {exc}")
    else:
        raise AssertionError("save should have failed")
    dist.barrier()
    check(not os.path.exists(f"{ck}/failed"), "nothing committed")
    check(not any(n.startswith(".failed") for n in os.listdir(ck)), "no temp dir left")
    # rank-local plain tensors (not replicated) are caught at commit
    try:
        ucp.save({"only_here" if rank == 0 else "other": torch.ones(2)}, f"{ck}/bad-plain")
    except ucp.CommitError as exc:
        check("cover" in str(exc), str(exc))
    else:
        raise AssertionError("non-replicated plain tensors should fail the commit")


def main() -> None:
    scenario, rank, world, init_file, ck = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for step in scenario.split(","):
            {"save2": save2, "load4": load4, "fail_one": fail_one}[step](rank, world, ck)
            dist.barrier()
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
