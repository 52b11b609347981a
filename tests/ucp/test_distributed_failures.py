"""Edge cases of multi-rank saves and loads under torch.distributed (gloo, real processes, 2-3 ranks).

Each world is started once per module (this file is also the worker: ``python THIS SCENARIO RANK WORLD
DIR``). Workers run every case, record what they saw (flags, error types and messages, files on
disk, byte ranges read) in ``DIR/result-<scenario>-<rank>.json``, and the tests below assert on those
records, so that one surprising case never hides the others.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest  # noqa: E402
import torch  # noqa: E402
from ucp_helpers import random_tensor, same_bytes  # noqa: E402

import ucp  # noqa: E402

W = random_tensor(torch.float32, (8, 6), seed=21)  # row shards, 4 rows per rank
F = random_tensor(torch.int64, (5, 7), seed=22)  # flat shards, uneven cut
R = random_tensor(torch.float16, (3, 3), seed=23)  # a truly replicated plain tensor
Q = random_tensor(torch.bfloat16, (3, 4), seed=24)  # rank 0 holds all rows, rank 1 an empty box
P0 = random_tensor(torch.float32, (5,), seed=25)  # pipeline stage 0's own tensor
P1 = random_tensor(torch.int32, (2, 3), seed=26)  # pipeline stage 1's own tensor
BIG = random_tensor(torch.float32, (32, 1024), seed=27)  # 64 KiB per rank, rows of 4 KiB
CUT = [0, 16, 35]


# ================================================================================================
# worker side
# ================================================================================================


def _err(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "msg": str(exc), "checkpoint_error": isinstance(exc, ucp.CheckpointError)}


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run one case; every rank must reach the same collectives, so errors are recorded, not raised."""
    try:
        return {"ok": True, "value": fn()}
    except BaseException as exc:  # noqa: BLE001 - recorded for the test to judge
        return {"ok": False, "error": _err(exc), "tb": traceback.format_exc()[-2000:]}


def _leftovers(ck: str, name: str) -> list[str]:
    return sorted(n for n in os.listdir(ck) if n.startswith(f".{name}."))


class ReadSpy:
    """Records every (file, offset, length) the local storage reads (headers and data)."""

    def __init__(self) -> None:
        from ucp.store.storage import LocalStorage

        self.reads: list[tuple[str, int, int]] = []
        self._cls = LocalStorage
        self._into, self._ranges = LocalStorage.read_into, LocalStorage.read_ranges
        spy = self

        def read_into(storage: Any, rel: str, offset: int, dest: memoryview) -> None:
            spy.reads.append((os.path.basename(rel), offset, memoryview(dest).nbytes))
            return spy._into(storage, rel, offset, dest)

        def read_ranges(storage: Any, rel: str, ranges: Any) -> None:
            ranges = list(ranges)
            spy.reads.extend((os.path.basename(rel), off, memoryview(d).nbytes) for off, d in ranges)
            return spy._ranges(storage, rel, ranges)

        LocalStorage.read_into, LocalStorage.read_ranges = read_into, read_ranges

    def __enter__(self) -> "ReadSpy":
        return self

    def __exit__(self, *exc: object) -> None:
        self._cls.read_into, self._cls.read_ranges = self._into, self._ranges


def _piece_spans(m: ucp.Manifest, tensor: str) -> list[tuple[str, int, int]]:
    return [(p.file, p.offset, p.length) for p in m.tensors[tensor].pieces]


def _state_main(rank: int) -> dict[str, Any]:
    return {
        "model": {
            "w": ucp.ShardedTensor(W[rank * 4 : (rank + 1) * 4].clone(), (8, 6), (rank * 4, 0)),
            "r": R.clone(),
            "d": torch.full((4,), float(rank)),  # plain tensor whose values DIFFER between ranks
            "q": ucp.ShardedTensor(Q.clone() if rank == 0 else Q[3:].clone(), (3, 4), (3 * rank, 0)),
        },
        "optim": {
            "state": {0: {"f": ucp.FlatShard(F.reshape(-1)[CUT[rank] : CUT[rank + 1]].clone(), (5, 7), CUT[rank])}},
            "param_groups": [{"lr": 0.1 * (rank + 1), "params": [0]}],
        },  # differs between ranks
        f"only_rank{rank}": {"seed": rank},
        "common": 7,
    }


def _check_full(out: dict[str, Any]) -> dict[str, bool]:
    return {
        "w": same_bytes(out["model"]["w"], W),
        "r": same_bytes(out["model"]["r"], R),
        "q": same_bytes(out["model"]["q"], Q),
        "f": same_bytes(out["optim"]["state"][0]["f"], F),
        "plain": out["common"] == 7 and out["only_rank0"] == {"seed": 0} and out["only_rank1"] == {"seed": 1},
    }


def scenario_main(rank: int, world: int, ck: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ucp.saving import sync_save as saving
    from ucp.saving.plan import PLAN_CACHE

    res: dict[str, Any] = {}
    path = f"{ck}/main"
    m = ucp.save(_state_main(rank), path, step=5, metadata={"rank_says": rank}, mesh={"dp": 2})
    # no barrier: save returns on every rank only once the checkpoint is committed
    with open(f"{path}/manifest.json", "rb") as fh:
        res["manifest_same_as_disk"] = m.to_json() == fh.read()
    res["step_meta"] = [m.step, m.metadata]
    res["files"] = sorted(m.files)
    res["d_writer"] = m.tensors["model.d"].pieces[0].file
    res["d_pieces"] = len(m.tensors["model.d"].pieces)
    out = ucp.load(path)
    res["full"] = _check_full(out)
    res["d_value"] = out["model"]["d"].tolist()
    res["lr"] = out["optim"]["param_groups"][0]["lr"]
    res["full_pg"] = _check_full(ucp.load(path, process_group=dist.group.WORLD))

    # check_replicas: the same state fails on the differing plain tensor "d" (every rank raises, nothing
    # committed); with equal replicas (plain "r", a shard held by both ranks) it saves
    res["replicas_differ"] = _attempt(
        lambda: ucp.save(_state_main(rank), f"{ck}/replicas", check_replicas=True) and None
    )
    res["replicas_differ"]["exists"] = os.path.exists(f"{ck}/replicas")
    res["replicas_differ"]["leftovers"] = _leftovers(ck, "replicas")

    def held_by_both(top: torch.Tensor) -> dict[str, Any]:  # rows 0-2 written by rank 0, rows 2-8 by rank 1
        return {
            "r": R.clone(),
            "s": ucp.Shards(
                [
                    ucp.ShardedTensor(top, (8, 6), (0, 0), replica_id=rank),
                    ucp.ShardedTensor(W[2:].clone(), (8, 6), (2, 0), replica_id=1 - rank),
                ]
            ),
        }

    res["replicas_equal"] = _attempt(
        lambda: ucp.save(held_by_both(W[:2].clone()), f"{ck}/replicas-ok", check_replicas=True) and None
    )
    res["shard_replica_differs"] = _attempt(
        lambda: ucp.save(held_by_both(W[:2].clone() + rank), f"{ck}/replicas-shard", check_replicas=True) and None
    )

    # load(into=) of this rank's own shards: only its own file, only its own pieces
    spans = {t: _piece_spans(m, t) for t in ("model.w", "optim.state.0.f")}
    for verify in (True, False):
        into = {
            "model": {"w": ucp.ShardedTensor(torch.zeros(4, 6), (8, 6), (rank * 4, 0))},
            "optim": {
                "state": {
                    0: {
                        "f": ucp.FlatShard(torch.zeros(CUT[rank + 1] - CUT[rank], dtype=torch.int64), (5, 7), CUT[rank])
                    }
                }
            },
        }
        with ReadSpy() as spy:
            ucp.load(path, into=into, verify=verify, process_group=dist.group.WORLD)
        res[f"into_{verify}"] = {
            "w": same_bytes(into["model"]["w"].local, W[rank * 4 : (rank + 1) * 4].contiguous()),
            "f": same_bytes(
                into["optim"]["state"][0]["f"].local, F.reshape(-1)[CUT[rank] : CUT[rank + 1]].contiguous()
            ),
            "reads": spy.reads,
            "spans": spans,
        }
    # one 4 KiB row in the middle of this rank's 64 KiB, no CRC check: just that row's (aligned) bytes
    big = ucp.ShardedTensor(BIG[rank * 16 : (rank + 1) * 16].clone(), (32, 1024), (rank * 16, 0))
    mb = ucp.save({"big": big}, f"{ck}/big")
    into = {"big": ucp.ShardedTensor(torch.zeros(1, 1024), (32, 1024), (rank * 16 + 5, 0))}
    with ReadSpy() as spy:
        ucp.load(f"{ck}/big", into=into, verify=False)
    res["into_row"] = {
        "ok": same_bytes(into["big"].local, BIG[rank * 16 + 5 : rank * 16 + 6].contiguous()),
        "reads": spy.reads,
        "spans": _piece_spans(mb, "big"),
    }

    # plan cache: rank 1 changes its layout between saves, rank 0 does not; then new values, same layout
    def cache_case() -> dict[str, Any]:
        PLAN_CACHE.clear()
        w1 = ucp.ShardedTensor(W[rank * 4 : (rank + 1) * 4].clone(), (8, 6), (rank * 4, 0))
        ucp.save({"w": w1}, f"{ck}/cache1")
        w2 = w1 if rank == 0 else ucp.FlatShard(W.reshape(-1)[24:].clone(), (8, 6), 24)
        ucp.save({"w": w2}, f"{ck}/cache2")
        after_layout_change = (PLAN_CACHE.hits, PLAN_CACHE.misses)
        w1.local.mul_(-1)  # same tensors, same layout, new values: the plan is reused, the data is not stale
        w3 = w1 if rank == 0 else ucp.FlatShard(-W.reshape(-1)[24:], (8, 6), 24)
        ucp.save({"w": w3}, f"{ck}/cache3")
        return {
            "counts": [after_layout_change, (PLAN_CACHE.hits, PLAN_CACHE.misses)],
            "cache2": same_bytes(ucp.load(f"{ck}/cache2")["w"], W),
            "cache3": same_bytes(ucp.load(f"{ck}/cache3")["w"], -W),
        }

    res["cache"] = _attempt(cache_case)

    # pipeline stages: each rank its own keys; rank-local full tensors wrapped as ShardedTensor save fine,
    # rank-local plain tensors are refused at commit
    stage = (
        {"stage0": {"p": ucp.ShardedTensor(P0.clone(), (5,), (0,))}}
        if rank == 0
        else {"stage1": {"p": ucp.ShardedTensor(P1.clone(), (2, 3), (0, 0))}, "sched": {"k": 1}}
    )
    res["pipe_sharded"] = _attempt(lambda: ucp.save(stage, f"{ck}/pipe") and None)
    if res["pipe_sharded"]["ok"]:
        o = ucp.load(f"{ck}/pipe")
        res["pipe_loaded"] = (
            same_bytes(o["stage0"]["p"], P0) and same_bytes(o["stage1"]["p"], P1) and o["sched"] == {"k": 1}
        )
    plain_stage = {"stage0": {"p": P0.clone()}} if rank == 0 else {"stage1": {"p": P1.clone()}}
    res["pipe_plain"] = _attempt(lambda: ucp.save(plain_stage, f"{ck}/pipe-plain"))
    # a key that is a value on rank 0 and a tensor on rank 1
    conflict = {"x": 5} if rank == 0 else {"x": ucp.ShardedTensor(torch.ones(2), (2,), (0,))}
    res["type_conflict"] = _attempt(lambda: ucp.save(conflict, f"{ck}/conflict"))

    # shards that do not tile the tensor
    T = torch.arange(8.0)
    bad = {
        "overlap": ucp.ShardedTensor(T[:5].clone(), (8,), (0,))
        if rank == 0
        else ucp.ShardedTensor(T[3:].clone(), (8,), (3,)),
        "gap": ucp.ShardedTensor(T[:3].clone(), (8,), (0,))
        if rank == 0
        else ucp.ShardedTensor(T[4:].clone(), (8,), (4,)),
        "both_replica0": ucp.ShardedTensor(T.clone(), (8,), (0,), replica_id=0),
        "no_replica0": ucp.ShardedTensor(T.clone(), (8,), (0,), replica_id=rank + 1),
    }
    for case, value in bad.items():
        res[case] = _attempt(
            lambda: ucp.save(
                {"good": ucp.ShardedTensor(T[rank * 4 : rank * 4 + 4].clone(), (8,), (rank * 4,)), "bad": value},
                f"{ck}/{case}",
            )
        )
        res[case]["leftovers"] = _leftovers(ck, case)
        res[case]["exists"] = os.path.exists(f"{ck}/{case}")

    # a rank raising while writing its file: every rank raises, the previous checkpoint stays, no temp dir
    ucp.save({"w": ucp.ShardedTensor(W[rank * 4 : (rank + 1) * 4].clone(), (8, 6), (rank * 4, 0))}, f"{ck}/keep")
    real_write = saving.write_rank_file
    for failing in (0, 1):

        def write(*a: Any, **k: Any) -> Any:
            if rank == failing:
                raise OSError(28, f"No space left on device (injected on rank {failing})")
            return real_write(*a, **k)

        saving.write_rank_file = write
        try:
            r = _attempt(
                lambda: ucp.save({"w": ucp.ShardedTensor(torch.zeros(4, 6), (8, 6), (rank * 4, 0))}, f"{ck}/keep")
            )
        finally:
            saving.write_rank_file = real_write
        dist.barrier()
        r["leftovers"] = _leftovers(ck, "keep")
        r["old_intact"] = same_bytes(ucp.load(f"{ck}/keep")["w"], W)
        res[f"write_fails_on_{failing}"] = r
    return res


def scenario_sub(rank: int, world: int, ck: str) -> dict[str, Any]:
    """3 ranks: a save by the subgroup {1, 2}; a non-member's call; a 3-rank overlap; a rank with no tensors."""
    import torch.distributed as dist

    res: dict[str, Any] = {}
    sub = dist.new_group([1, 2])
    path = f"{ck}/sub"
    if rank in (1, 2):
        g = dist.get_rank(sub)
        state = {"w": ucp.ShardedTensor(W[g * 4 : (g + 1) * 4].clone(), (8, 6), (g * 4, 0)), "r": R.clone(), "step": 3}
        m = ucp.save(state, path, process_group=sub, mesh={"dp": 2})
        res["topology"] = [m.topology.world_size, m.topology.mesh]
        res["files"] = {f: i.rank for f, i in m.files.items()}
        res["full"] = same_bytes(ucp.load(path, process_group=sub)["w"], W)
        into = {
            "w": ucp.ShardedTensor(torch.zeros(4, 6), (8, 6), (g * 4, 0)),
            "r": torch.zeros(3, 3, dtype=torch.float16),
        }
        ucp.load(path, into=into, process_group=sub)
        res["into"] = same_bytes(into["w"].local, W[g * 4 : (g + 1) * 4].contiguous()) and same_bytes(into["r"], R)
        res["manifest_same_as_disk"] = m.to_json() == Path(f"{path}/manifest.json").read_bytes()
    dist.barrier()
    if rank == 0:  # not in the subgroup: a clear error, no files touched
        res["nonmember_save"] = _attempt(lambda: ucp.save({"w": torch.ones(2)}, f"{ck}/nonmember", process_group=sub))
        res["nonmember_load"] = _attempt(lambda: ucp.load(path, process_group=sub))
        res["nonmember_files"] = sorted(n for n in os.listdir(ck) if "nonmember" in n)
    dist.barrier()
    # overlap between ranks 1 and 2 only
    rows = [(0, 2), (2, 5), (4, 8)][rank]
    res["overlap3"] = _attempt(
        lambda: ucp.save({"w": ucp.ShardedTensor(W[rows[0] : rows[1]].clone(), (8, 6), (rows[0], 0))}, f"{ck}/overlap3")
    )
    # rank 2 holds no tensor at all
    state = {"w": ucp.ShardedTensor(W[rank * 4 : (rank + 1) * 4].clone(), (8, 6), (rank * 4, 0))} if rank < 2 else {}
    state["step"] = 9
    m = ucp.save(state, f"{ck}/none-on-2")
    res["none_on_2"] = {
        "files": sorted(m.files),
        "w": same_bytes(ucp.load(f"{ck}/none-on-2")["w"], W),
        "on_disk": sorted(os.listdir(f"{ck}/none-on-2")),
    }
    return res


def scenario_front(rank: int, world: int, ck: str) -> dict[str, Any]:
    """Rank 1 passes metadata that is not JSON (NaN): it raises before any collective."""
    res: dict[str, Any] = {}
    state = {"w": ucp.ShardedTensor(W[rank * 4 : (rank + 1) * 4].clone(), (8, 6), (rank * 4, 0))}
    t0 = time.monotonic()
    res["save"] = _attempt(
        lambda: ucp.save(state, f"{ck}/front", metadata={"loss": float("nan") if rank == 1 else 1.0})
    )
    res["seconds"] = time.monotonic() - t0
    res["leftovers"] = _leftovers(ck, "front")
    return res


def scenario_death(rank: int, world: int, ck: str) -> dict[str, Any]:
    """Rank 1's process dies while writing its file; rank 0 is alive and owns the temporary directory."""
    from ucp.saving import sync_save as saving

    real_write = saving.write_rank_file

    def write(*a: Any, **k: Any) -> Any:
        if rank == 1:
            os._exit(3)
        return real_write(*a, **k)

    saving.write_rank_file = write
    res: dict[str, Any] = {}
    state = {"w": ucp.ShardedTensor(W[rank * 4 : (rank + 1) * 4].clone(), (8, 6), (rank * 4, 0))}
    res["save"] = _attempt(lambda: ucp.save(state, f"{ck}/death"))
    res["leftovers"] = _leftovers(ck, "death")
    return res


SCENARIOS = {"main": scenario_main, "sub": scenario_sub, "front": scenario_front, "death": scenario_death}
GLOO_TIMEOUT = {"front": 5, "death": 20}  # seconds; the others keep a generous one


def worker_main() -> None:
    import torch.distributed as dist

    scenario, rank, world, ck = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    timeout = datetime.timedelta(seconds=GLOO_TIMEOUT.get(scenario, 120))
    dist.init_process_group(
        "gloo", init_method=f"file://{ck}/.init-{scenario}", rank=rank, world_size=world, timeout=timeout
    )
    res = SCENARIOS[scenario](rank, world, ck)
    out = Path(ck) / f"result-{scenario}-{rank}.json"
    tmp = out.with_suffix(".part")
    tmp.write_text(json.dumps(res))
    tmp.rename(out)
    if scenario in ("front", "death"):  # the group is broken: no barrier; stay until rank 0 has its answer
        deadline = time.monotonic() + 60
        while rank != 0 and not (Path(ck) / f"result-{scenario}-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    dist.barrier()
    dist.destroy_process_group()


# ================================================================================================
# test side
# ================================================================================================


def run_world(scenario: str, world: int, ck: Path, allowed_rc: dict[int, int] | None = None) -> list[dict]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, scenario, str(r), str(world), str(ck)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    allowed_rc = allowed_rc or {}
    failed = [(r, p.returncode, o) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode != allowed_rc.get(r, 0)]
    assert not failed, "\n".join(f"--- rank {r} rc={rc} ---\n{o[-3000:]}" for r, rc, o in failed)
    results = []
    for r in range(world):
        f = ck / f"result-{scenario}-{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return results


@pytest.fixture(scope="module")
def main2(tmp_path_factory):
    ck = tmp_path_factory.mktemp("main")
    return run_world("main", 2, ck), ck


@pytest.fixture(scope="module")
def sub3(tmp_path_factory):
    ck = tmp_path_factory.mktemp("sub")
    return run_world("sub", 3, ck), ck


@pytest.fixture(scope="module")
def front2(tmp_path_factory):
    ck = tmp_path_factory.mktemp("front")
    return run_world("front", 2, ck), ck


@pytest.fixture(scope="module")
def death2(tmp_path_factory):
    ck = tmp_path_factory.mktemp("death")
    return run_world("death", 2, ck, allowed_rc={1: 3}), ck


# -- saves that work ------------------------------------------------------------------------------


def test_every_rank_gets_the_committed_manifest_and_full_state(main2):
    res, ck = main2
    for r in res:
        assert r["manifest_same_as_disk"]  # the returned manifest is the one on disk, on every rank
        assert r["files"] == ["rank-00000.safetensors", "rank-00001.safetensors"]
        assert r["full"] == r["full_pg"] == {"w": True, "r": True, "q": True, "f": True, "plain": True}
    # the empty box of q on rank 1 is a zero-length piece that the checks accept
    m = ucp.read_manifest(ck / "main")
    assert sorted(p.length for p in m.tensors["model.q"].pieces) == [0, 24]
    assert ucp.verify(ck / "main").ok


def test_step_and_metadata_come_from_rank_0(main2):
    res, _ = main2
    assert [r["step_meta"] for r in res] == [[5, {"rank_says": 0}]] * 2


def test_differing_plain_tensor_is_silently_taken_from_its_writer_rank(main2):
    """Documented (ucp/saving/plan.py, ucp.save): plain tensors are ASSUMED equal on every rank and, unless
    ``check_replicas``, not checked; the copy kept is that of the rank the deterministic assignment
    picked, not always rank 0."""
    res, ck = main2
    writer = int(res[0]["d_writer"][len("rank-") : -len(".safetensors")])
    assert res[0]["d_pieces"] == 1
    assert res[0]["d_value"] == res[1]["d_value"] == [float(writer)] * 4


def test_check_replicas_fails_a_save_whose_replicas_differ(main2):
    res, ck = main2
    writer = int(res[0]["d_writer"][len("rank-") : -len(".safetensors")])
    for r in res:
        case = r["replicas_differ"]
        assert not case["ok"] and case["error"]["type"] == "CommitError", case
        msg = case["error"]["msg"]
        assert "tensor 'model.d'" in msg and f"rank {1 - writer}'s copy" in msg and f"rank {writer} wrote" in msg
        assert not case["exists"] and case["leftovers"] == []
        assert r["replicas_equal"]["ok"], r["replicas_equal"]
        shard = r["shard_replica_differs"]
        assert (
            not shard["ok"]
            and "tensor 's'" in shard["error"]["msg"]
            and "rank 1's copy of box" in shard["error"]["msg"]
        )
    assert same_bytes(ucp.load(ck / "replicas-ok")["s"], W)


def test_differing_plain_values_are_taken_from_the_lowest_rank(main2):
    """Documented in ucp.format.tree.merge_trees: no error, rank 0's value wins, rank-specific keys are unioned."""
    res, _ = main2
    assert res[0]["lr"] == res[1]["lr"] == 0.1
    assert res[0]["full"]["plain"]


def test_load_into_reads_only_this_ranks_pieces(main2):
    res, _ = main2
    for rank, r in enumerate(res):
        own = f"rank-0000{rank}.safetensors"
        for verify in (True, False):
            case = r[f"into_{verify}"]
            assert case["w"] and case["f"]
            pieces = [tuple(s) for t in case["spans"].values() for s in t if s[0] == own]
            data_reads = [x for x in case["reads"] if x[1] >= 4096]  # past the header page
            assert {x[0] for x in case["reads"]} == {own}, case["reads"]  # never the other rank's file
            assert sorted(tuple(x) for x in data_reads) == sorted(pieces), (data_reads, pieces)


def test_load_into_one_row_reads_just_that_row(main2):
    res, _ = main2
    for rank, r in enumerate(res):
        case = r["into_row"]
        assert case["ok"]
        ((file, offset, _length),) = [s for s in case["spans"] if s[0] == f"rank-0000{rank}.safetensors"]
        start, end = offset + 5 * 4096, offset + 6 * 4096  # row 5 of the rank's 16 rows of 4 KiB
        lo, hi = start - start % 4096, -(-end // 4096) * 4096  # staged reads are 4 KiB aligned
        data_reads = [tuple(x) for x in case["reads"] if x[1] >= 4096]
        assert data_reads == [(file, lo, hi - lo)], case["reads"]


def test_plan_cache_when_one_ranks_layout_changes(main2):
    res, _ = main2
    for rank, r in enumerate(res):
        case = r["cache"]
        assert case["ok"], case
        v = case["value"]
        assert v["cache2"] and v["cache3"]  # bit-exact after a layout change and after new values
        # rank 0 kept its layout (hit); rank 1 changed it (miss); the third save hits on both
        assert v["counts"] == ([[1, 1], [2, 1]] if rank == 0 else [[0, 2], [1, 2]])


def test_pipeline_stages_with_wrapped_tensors_merge(main2):
    res, _ = main2
    assert all(r["pipe_sharded"]["ok"] and r["pipe_loaded"] for r in res)


def test_subgroup_save_and_load(sub3):
    res, ck = sub3
    for r in res[1:]:
        assert r["topology"] == [2, {"dp": 2}]
        assert r["files"] == {"rank-00000.safetensors": 0, "rank-00001.safetensors": 1}
        assert r["full"] and r["into"] and r["manifest_same_as_disk"]
    assert ucp.verify(ck / "sub").ok


def test_rank_with_no_tensors_writes_no_file(sub3):
    res, _ = sub3
    for r in res:
        assert r["none_on_2"]["files"] == ["rank-00000.safetensors", "rank-00001.safetensors"]
        assert r["none_on_2"]["on_disk"] == ["manifest.json", "rank-00000.safetensors", "rank-00001.safetensors"]
        assert r["none_on_2"]["w"]


# -- saves that must fail on every rank, naming the cause ---------------------------------------------


@pytest.mark.parametrize(
    "case,why",
    [
        ("overlap", "overlap"),
        ("gap", "cover 7 of 8"),
        ("both_replica0", "overlap"),
        ("no_replica0", "cover 0 of 8"),
    ],
)
def test_shards_that_do_not_tile_fail_on_every_rank_naming_the_tensor(main2, case, why):
    res, _ = main2
    for r in res:
        c = r[case]
        assert not c["ok"] and c["error"]["type"] == "CommitError", c
        assert "tensor 'bad'" in c["error"]["msg"] and why in c["error"]["msg"]
        assert c["leftovers"] == [] and not c["exists"]


def test_rank_local_plain_tensors_fail_naming_the_tensor(main2):
    res, _ = main2
    for r in res:
        c = r["pipe_plain"]
        assert not c["ok"] and c["error"]["type"] == "CommitError"
        assert "stage1.p" in c["error"]["msg"] and "plain tensors must be present on every rank" in c["error"]["msg"]


def test_value_on_one_rank_tensor_on_another_fails(main2):
    res, _ = main2
    for r in res:
        c = r["type_conflict"]
        assert not c["ok"] and c["error"]["type"] == "CommitError" and "'x'" in c["error"]["msg"]


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_raising_while_writing_fails_all_and_keeps_the_old(main2, failing):
    res, _ = main2
    for rank, r in enumerate(res):
        c = r[f"write_fails_on_{failing}"]
        assert not c["ok"]
        if rank == failing:  # its own error, unchanged
            assert c["error"]["type"] == "OSError" and "injected" in c["error"]["msg"]
        else:
            assert (
                c["error"]["checkpoint_error"]
                and f"rank {failing}" in c["error"]["msg"]
                and "injected" in c["error"]["msg"]
            )
        assert c["leftovers"] == [] and c["old_intact"]


# -- bugs -------------------------------------------------------------------------------------------


def test_overlap_error_names_the_ranks_at_fault(sub3):
    res, _ = sub3
    msg = res[0]["overlap3"]["error"]["msg"]
    assert "tensor 'w'" in msg and "overlap" in msg  # holds today
    assert all(f"rank {k}" in msg or f"rank-0000{k}" in msg for k in (1, 2)), msg


def test_non_member_of_the_process_group_gets_a_clear_error(sub3):
    res, _ = sub3
    r = res[0]
    assert r["nonmember_files"] == []
    for case in ("nonmember_save", "nonmember_load"):
        c = r[case]
        assert not c["ok"]
        assert c["error"]["type"] in ("ValueError", "CheckpointError", "CommitError"), c["error"]
        assert "member" in c["error"]["msg"] or "not in" in c["error"]["msg"], c["error"]


def test_argument_error_on_one_rank_fails_the_others_cleanly(front2):
    res, _ = front2
    assert res[1]["save"]["error"]["type"] == "UnsupportedStateError"  # holds today
    c = res[0]["save"]
    assert not c["ok"] and c["error"]["checkpoint_error"] and "rank 1" in c["error"]["msg"], c["error"]
    assert res[0]["seconds"] < 4  # not the gloo timeout (5 s here, 30 min by default)


def test_argument_error_on_one_rank_leaves_no_temp_dir(front2):
    res, ck = front2
    assert not res[0]["save"]["ok"]
    assert res[0]["leftovers"] == [] and _leftovers(str(ck), "front") == []


def test_peer_death_mid_save_cleans_up_on_the_survivor(death2):
    res, ck = death2
    assert res[1] is None  # rank 1 died before recording anything
    c = res[0]["save"]
    assert not c["ok"] and not os.path.exists(ck / "death")  # holds today: nothing committed, rank 0 raised
    assert _leftovers(str(ck), "death") == [], _leftovers(str(ck), "death")


if __name__ == "__main__":
    worker_main()
