"""One rank of the 2-rank asynchronous save test (tests/ucp/saving/test_async_save.py), and the saver modes
those tests run in.

usage: python async_save_worker.py RANK WORLD INIT_FILE CKPT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
from ucp_helpers import random_tensor, same_bytes
from world import init_gloo

import ucp
from ucp.saving.async_save import AsyncSaver
from ucp.saving.cow import snapshot as ucp_cow

MODES = ["thread", "process"]  # "thread" copies before returning (snapshot="sync") in these tests
COW = None if ucp_cow.cow_unavailable() else "cow"  # copy-on-write snapshots, where this machine allows them
ALL = MODES + ([COW] if COW else [])


def make_saver(mode: str, **kw) -> AsyncSaver:
    """A saver of one test mode: "thread" and "process" copy before returning, "cow" protects and copies later."""
    if mode == "cow":
        return AsyncSaver(mode="thread", snapshot="cow", **kw)
    if mode == "thread":
        return AsyncSaver(mode="thread", snapshot="sync", **kw)
    if mode == "process":
        return AsyncSaver(mode="process", snapshot="sync", **kw)
    raise ValueError(f"unknown test mode {mode!r}; known: {ALL}")


W = random_tensor(torch.float32, (8, 6), seed=31)
F = random_tensor(torch.int64, (5, 7), seed=32)
R = random_tensor(torch.float16, (3, 3), seed=33)


def rank_state(rank: int) -> dict:
    cut = [0, 16, 35]
    return {
        "w": ucp.ShardedTensor(W[rank * 4 : (rank + 1) * 4].clone(), (8, 6), (rank * 4, 0)),
        "f": ucp.FlatShard(F.reshape(-1)[cut[rank] : cut[rank + 1]].clone(), (5, 7), cut[rank]),
        "r": R.clone(),
        "step": 7,
    }


def worker(rank: int, world: int, init: str, ck: str) -> None:
    import torch.distributed as dist

    init_gloo(init, rank, world)
    savers = {m: make_saver(m) for m in ALL}
    savers["process"].start(wait=False)  # its writer process starts up while the thread mode runs
    for mode in ALL:
        with savers[mode] as saver:
            for round_ in range(2):  # the second save replaces the first (the commit's exchange path)
                state = rank_state(rank)
                h = saver.save(state, f"{ck}/{mode}", step=7 + round_, mesh={"dp": 2})
                state["w"].local.zero_()
                state["f"].local.zero_()
                state["r"].zero_()
                dist.barrier()  # training collectives go on while the writers work
                m = h.result(timeout=120)
                assert m.step == 7 + round_ and m.topology.world_size == 2, m
            dist.barrier()
            if rank == 0:
                back = ucp.load(f"{ck}/{mode}")
                assert same_bytes(back["w"], W) and same_bytes(back["f"], F) and same_bytes(back["r"], R)
                assert sorted(os.listdir(f"{ck}/{mode}")) == [
                    "manifest.json",
                    "rank-00000.safetensors",
                    "rank-00001.safetensors",
                ]
            # one rank fails before its snapshot: it raises at once, the other's result() raises
            bad = rank_state(rank)
            if rank == 1:
                bad["oops"] = {1, 2}
                try:
                    saver.save(bad, f"{ck}/{mode}-bad", step=1)
                except ucp.UnsupportedStateError:
                    pass
                else:
                    raise AssertionError("rank 1 should have raised")
            else:
                h = saver.save(bad, f"{ck}/{mode}-bad", step=1)
                try:
                    h.result(timeout=120)
                except ucp.CommitError as exc:
                    assert "rank 1" in str(exc), exc
                else:
                    raise AssertionError("rank 0's save should have failed")
            dist.barrier()
            leftovers = [n for n in os.listdir(ck) if n.startswith(".")]
            assert not leftovers, leftovers
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
