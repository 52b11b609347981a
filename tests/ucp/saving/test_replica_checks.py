"""``check_replicas``: equal replicas of any dtype and memory layout commit; a drifted one is refused,
naming the tensor, the region and both ranks; off (the default), nothing is compared."""

from __future__ import annotations

import pytest
import torch
from ucp_helpers import random_tensor, run_ranks, same_bytes, save_ranks

import ucp
from ucp import AsyncSaver
from ucp.saving.background.job import WriteJob
from ucp.store import commit as _commit


def _flip(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    """A copy of ``t`` with one bit of one byte flipped."""
    out = t.clone()
    out.reshape(-1).view(torch.uint8)[index] ^= 1
    return out


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in non-contiguous memory (a column-major copy)."""
    if t.dim() < 2:
        return torch.stack([t, t], dim=-1)[..., 0]
    return t.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.int8, torch.float16]
)
def test_equal_plain_replicas_of_any_dtype_and_layout_commit(tmp_path, dtype):
    w = random_tensor(dtype, (5, 7), seed=1)
    assert not _strided(w).is_contiguous()
    states = [
        {"w": w.clone(), "e": torch.empty(0, 3, dtype=dtype), "s": w[0, 0].clone()},
        {"w": _strided(w), "e": torch.empty(0, 3, dtype=dtype), "s": w[0, 0].clone()},
        {"w": w.clone(), "e": torch.empty(0, 3, dtype=dtype), "s": w[0, 0].clone()},
    ]
    save_ranks(tmp_path / "c", states, check_replicas=True)
    out = ucp.load(tmp_path / "c")
    assert same_bytes(out["w"], w) and out["e"].shape == (0, 3)


def test_a_conjugate_view_replica_equals_its_resolved_copy(tmp_path):
    z = random_tensor(torch.complex64, (4, 4), seed=2)
    states = [{"z": z.clone()}, {"z": z.conj().clone().conj()}]  # conj bit set, same values
    assert states[1]["z"].is_conj()
    save_ranks(tmp_path / "c", states, check_replicas=True)
    assert same_bytes(ucp.load(tmp_path / "c")["z"], z)


def _writer_of(name: str, path) -> int:
    m = ucp.read_manifest(path)
    return m.files[m.tensors[name].pieces[0].file].rank


def test_a_drifted_plain_replica_names_the_tensor_and_both_ranks(tmp_path):
    """Two plain tensors: the larger goes to rank 0, the other to rank 1; rank 0's copy of rank 1's drifts."""
    big, small = random_tensor(torch.float32, (64,), seed=3), random_tensor(torch.float32, (8,), seed=4)
    save_ranks(tmp_path / "probe", [{"big": big, "small": small}] * 2, check_replicas=True)
    assert _writer_of("big", tmp_path / "probe") == 0 and _writer_of("small", tmp_path / "probe") == 1
    states = [{"big": big.clone(), "small": _flip(small, 5)}, {"big": big.clone(), "small": small.clone()}]
    with pytest.raises(
        ucp.CommitError,
        match=r"tensor 'small': rank 0's copy of box .*\[8\].* differs from the one "
        r"rank 1 wrote",
    ):
        save_ranks(tmp_path / "bad", states, check_replicas=True)
    assert not (tmp_path / "bad").exists()
    save_ranks(tmp_path / "off", states)  # default: rank 1's copy, no comparison
    assert same_bytes(ucp.load(tmp_path / "off")["small"], small)


def test_a_drifted_shard_replica_of_a_shards_part_is_refused(tmp_path):
    w = random_tensor(torch.bfloat16, (4, 6), seed=5)

    def state(rank: int, drift: bool) -> dict:
        mine = _flip(w, 2 * 6 * 2 + 3) if drift and rank == 1 else w.clone()  # rank 1 writes rows 2:
        return {
            "w": ucp.Shards(
                [
                    ucp.ShardedTensor(mine[:2].clone(), (4, 6), (0, 0), replica_id=rank),
                    ucp.ShardedTensor(mine[2:], (4, 6), (2, 0), replica_id=1 - rank),
                ]
            )
        }

    save_ranks(tmp_path / "ok", [state(0, False), state(1, False)], check_replicas=True)
    assert same_bytes(ucp.load(tmp_path / "ok")["w"], w)
    with pytest.raises(ucp.CommitError, match=r"tensor 'w': rank 0's copy of box .*\"offsets\":\[2,0\].*rank 1 wrote"):
        save_ranks(tmp_path / "bad", [state(0, True), state(1, True)], check_replicas=True)
    assert not (tmp_path / "bad").exists()


def test_flat_shard_replicas_across_three_ranks(tmp_path):
    flat = random_tensor(torch.float16, (30,), seed=6)

    def state(rank: int, drift: bool) -> dict:
        mine = _flip(flat, 2 * 20) if drift and rank == 2 else flat.clone()  # rank 2 writes [20, 30)
        return {
            "w": ucp.Shards(
                [
                    ucp.FlatShard(mine[10 * k : 10 * k + 10].clone(), (5, 6), 10 * k, replica_id=(rank - k) % 3)
                    for k in range(3)
                ]
            )
        }

    save_ranks(tmp_path / "ok", [state(r, False) for r in range(3)], check_replicas=True)
    assert same_bytes(ucp.load(tmp_path / "ok")["w"].reshape(-1), flat)
    with pytest.raises(
        ucp.CommitError,
        match=r"tensor 'w': rank 0's copy of elements .*\"start\":20,\"stop\":30"
        r".* rank 2 wrote",
    ):
        save_ranks(tmp_path / "bad", [state(r, True) for r in range(3)], check_replicas=True)


def test_check_replicas_off_sends_no_replicas(tmp_path):
    seen: list[list] = []
    real = _commit.build_manifest

    def spy(reports, **kw):
        seen.append([r.replicas for r in reports])
        return real(reports, **kw)

    import ucp.saving.sync_save

    mp = pytest.MonkeyPatch()
    mp.setattr(ucp.saving.sync_save._commit, "build_manifest", spy)
    try:
        w = random_tensor(torch.float32, (3, 3), seed=7)
        save_ranks(tmp_path / "c", [{"w": w}, {"w": _flip(w)}])
    finally:
        mp.undo()
    assert seen == [[[], []]]


def test_a_write_job_with_replicas_survives_the_process_writers_json():
    rep = _commit.Replica(tensor="w", box={"offsets": [2, 0], "shape": [2, 6]}, crc32c=0xDEADBEEF)
    flat = _commit.Replica(tensor="f", flat={"start": 10, "stop": 20}, crc32c=7)
    job = WriteJob(id=1, path="/x", name="x", temp=".x.tmp", replicas=[rep, flat])
    back = WriteJob.model_validate(job.model_dump(mode="json"))  # what ProcessBackend sends and the writer parses
    assert back.replicas == [rep, flat]
    report = _commit.RankReport(rank=1, replicas=back.replicas)
    assert _commit.RankReport.model_validate_json(report.model_dump_json()).replicas == [rep, flat]


@pytest.mark.parametrize("snapshot", ["sync", "background"])
def test_async_saver_with_strided_equal_replicas_commits(tmp_path, snapshot):
    w = random_tensor(torch.bfloat16, (6, 4), seed=8)

    def fn(group):
        mine = w.clone() if group.rank == 0 else _strided(w)
        with AsyncSaver(snapshot=snapshot) as saver:
            saver.save(
                {"w": mine, "b": torch.ones(3, dtype=torch.bool)},
                tmp_path / "c",
                process_group=group,
                check_replicas=True,
            ).result(60)

    run_ranks(2, fn)
    out = ucp.load(tmp_path / "c")
    assert same_bytes(out["w"], w) and out["b"].all()
