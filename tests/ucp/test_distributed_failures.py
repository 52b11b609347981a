"""Multi-rank saves and loads under torch.distributed that must work or fail cleanly (gloo, real processes,
2-3 ranks).

Each world is started once per module (tests/support/distributed_failures_worker.py, one scenario a
world). Workers run every case, record what they saw (flags, error types and messages, files on
disk, byte ranges read) in ``DIR/result-<scenario>-<rank>.json``, and the tests below assert on those
records, so that one surprising case never hides the others.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from distributed_failures_worker import W, _leftovers
from repo_paths import SUPPORT
from ucp_helpers import same_bytes
from world import run_world

import ucp

WORKER = SUPPORT / "distributed_failures_worker.py"


def run_scenario(
    scenario: str, world: int, ck: Path, allowed_rc: dict[int, int] | None = None
) -> list[dict[str, Any] | None]:
    """Run one scenario of tests/support/distributed_failures_worker.py; each rank's record (None if it has none)."""
    run_world(WORKER, lambda r: [scenario, r, world, ck], world, timeout=150, allowed_rc=allowed_rc)
    results = []
    for r in range(world):
        f = ck / f"result-{scenario}-{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return results


@pytest.fixture(scope="module")
def main2(tmp_path_factory):
    ck = tmp_path_factory.mktemp("main")
    return run_scenario("main", 2, ck), ck


@pytest.fixture(scope="module")
def sub3(tmp_path_factory):
    ck = tmp_path_factory.mktemp("sub")
    return run_scenario("sub", 3, ck), ck


@pytest.fixture(scope="module")
def front2(tmp_path_factory):
    ck = tmp_path_factory.mktemp("front")
    return run_scenario("front", 2, ck), ck


@pytest.fixture(scope="module")
def death2(tmp_path_factory):
    ck = tmp_path_factory.mktemp("death")
    return run_scenario("death", 2, ck, allowed_rc={1: 3}), ck


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
