"""Offloaded optimizer state is checkpoint state: engine.save writes the masters and moments of the swap tier
as ordinary UCP pieces, engine.load puts them back; offload on -> off, off -> on, and 2 ranks at ZeRO-3 ->
1 rank at ZeRO-1 (every sub-group swapped, or some kept resident and resumed with another residency), each
continuing like the uninterrupted run; the moments really are restored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from offload_helpers import gpt_engine, optimizer_state, train_saving_at
from training_helpers import rel_close, run_world

import ucp
from training import Engine

WORKER = Path(__file__).resolve().parents[2] / "support" / "offload_worker.py"
MODEL = {"vocab_size": 1000, "n_layer": 2, "n_head": 4, "d_model": 128, "d_ff": 512, "max_seq": 32}
OPTIONS: dict[str, Any] = {"micro_batch": 2, "weight_decay": 0.1, "clip": 1.0, "lr": 3e-3}
SPLIT, STEPS = 3, 6


def nvme(path: Path) -> dict[str, Any]:
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(path)}, "sub_group_size": 65536}


def engine(off: dict[str, Any] | None, **options: Any) -> Engine:
    return gpt_engine(MODEL, OPTIONS, off, **options)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], Path]:
    """The in-memory run's losses, and its checkpoint after SPLIT steps."""
    root = tmp_path_factory.mktemp("memory")
    return train_saving_at(engine(None), root, STEPS, SPLIT)


def test_offload_on_to_off_and_on_to_on(tmp_path: Path, uninterrupted: tuple[list[float], Path]) -> None:
    ref, mem_path = uninterrupted
    root = tmp_path / "ckpt"
    a = engine(nvme(tmp_path))
    try:
        losses = []
        for s in range(STEPS):
            losses.append(a.train_step(s))
            if s + 1 == SPLIT:
                a.save(ucp.CheckpointManager(root))
                assert a.optimizer._staged is None  # the staged copy went with the save
        assert losses == ref  # saving did not disturb the tier
    finally:
        a.close()
    path = ucp.CheckpointManager(root).path(SPLIT)
    names = list(ucp.read_manifest(path).tensors)
    assert names == list(ucp.read_manifest(mem_path).tensors)
    assert any(n.startswith("optimizer.exp_avg_sq.") for n in names)
    ours, theirs = ucp.load(path), ucp.load(mem_path)
    for n in names:  # the same pieces, bit for bit, as the in-memory run's checkpoint
        assert torch.equal(_at(ours, n), _at(theirs, n)), n
    off = engine(None)
    assert off.load(path) == SPLIT
    assert [off.train_step(s) for s in range(SPLIT, STEPS)] == ref[SPLIT:]
    on = engine(nvme(tmp_path))
    try:
        assert on.load(path) == SPLIT
        assert [on.train_step(s) for s in range(SPLIT, STEPS)] == ref[SPLIT:]
    finally:
        on.close()


def test_offload_off_to_on_restores_the_moments(tmp_path: Path, uninterrupted: tuple[list[float], Path]) -> None:
    ref, path = uninterrupted
    on = engine(nvme(tmp_path))
    zeroed = engine(nvme(tmp_path))
    try:
        assert on.load(path) == SPLIT
        assert [on.train_step(s) for s in range(SPLIT, STEPS)] == ref[SPLIT:]
        zeroed.load(path)
        for key, _, t in zeroed.optimizer.buffers():  # stage, zero the moments, put them back in the tier
            if key in ("exp_avg", "exp_avg_sq"):
                t.zero_()
        zeroed.optimizer.publish()
        assert [zeroed.train_step(s) for s in range(SPLIT, STEPS)] != ref[SPLIT:]
    finally:
        on.close()
        zeroed.close()


def test_two_ranks_zero3_nvme_resume_at_one_rank_zero1(tmp_path: Path) -> None:
    swap, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    swap.mkdir()
    sc = {
        "name": "z3",
        "model": MODEL,
        "mesh": {"dp": 2},
        "options": {**OPTIONS, "zero_stage": 3},
        "offload": nvme(swap),
        "steps": STEPS,
        "save_at": SPLIT,
        "ckpt": str(ckpt),
    }
    run_world(2, [sc], tmp_path, timeout=300, worker=WORKER)
    ref = json.loads((tmp_path / "z3.rank0.json").read_text())["losses"]
    one = engine(nvme(swap), zero_stage=1, grad_accum=2)  # the same global batch on one rank
    try:
        assert one.load(ucp.CheckpointManager(ckpt)) == SPLIT
        resumed = [one.train_step(s) for s in range(SPLIT, STEPS)]
    finally:
        one.close()
    assert rel_close(resumed, ref[SPLIT:], 1e-5), (resumed, ref[SPLIT:])
    assert list(swap.iterdir()) == []


def test_two_ranks_with_resident_sub_groups_resume_at_one_rank_with_another_residency(tmp_path: Path) -> None:
    # 2 ranks at ZeRO-3, each with 6 sub-groups (3.9 MB of state): a 3 MiB budget keeps the pool's two 768 KiB
    # slots and two sub-groups resident (the small one and a whole one), so the checkpoint is written from
    # memory and from swap files at once; it resumes at 1 rank, ZeRO-1, where the sub-groups are cut elsewhere:
    # half of them resident by ratio 0.5, or every one swapped.
    swap, ckpt, mem = tmp_path / "nvme", tmp_path / "ckpt", tmp_path / "mem"
    swap.mkdir()
    base = {"model": MODEL, "mesh": {"dp": 2}, "options": {**OPTIONS, "zero_stage": 3}, "steps": STEPS}
    scenarios = [
        {**base, "name": "memory", "offload": None, "save_at": SPLIT, "ckpt": str(mem)},
        {
            **base,
            "name": "resident",
            "offload": {**nvme(swap), "swap_budget": 3 << 20},
            "save_at": SPLIT,
            "ckpt": str(ckpt),
        },
    ]
    run_world(2, scenarios, tmp_path, timeout=300, worker=WORKER)
    for rank in (0, 1):
        ref, res = (json.loads((tmp_path / f"{n}.rank{rank}.json").read_text()) for n in ("memory", "resident"))
        shape = res["tier"]
        assert shape["resident"] == 2 and shape["subgroups"] == 6 and shape["host_bytes"] <= 3 << 20
        assert shape["resident_bytes"] > shape["slot_bytes"]  # a whole sub-group, not only the small one
        assert res["last"]["bytes_read"] == shape["swapped_bytes"] > 0  # the others were swapped every step
        assert (res["losses"], res["digest"]) == (ref["losses"], ref["digest"]), rank
        assert res["dir_removed"] is True
    ref = json.loads((tmp_path / "memory.rank0.json").read_text())["losses"]
    path = ucp.CheckpointManager(ckpt).path(SPLIT)
    ours, theirs = ucp.load(path), ucp.load(ucp.CheckpointManager(mem).path(SPLIT))
    names = list(ucp.read_manifest(path).tensors)
    assert any(n.startswith("optimizer.exp_avg_sq.") for n in names)
    for n in names:  # the pieces of the resident and of the swapped sub-groups, bit for bit
        assert torch.equal(_at(ours, n), _at(theirs, n)), n

    one = {"zero_stage": 1, "grad_accum": 2}  # the same global batch on one rank
    half_off = {**nvme(swap), "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "ratio": 0.5}}
    memory = engine(None, **one)
    half = engine(half_off, **one)  # no budget: the ratio alone keeps half the sub-groups resident
    swapped = engine({**nvme(swap), "swap_budget": 3 << 20, "keep_resident": False}, **one)
    try:
        shapes = [e.optimizer.offload.describe() for e in (half, swapped) if e.optimizer.offload is not None]
        n = shapes[0]["subgroups"]
        assert [s["resident"] for s in shapes] == [n - n // 2, 0] and n > 6
        for e in (memory, half, swapped):
            assert e.load(ucp.CheckpointManager(ckpt)) == SPLIT
        state = optimizer_state(memory)
        for e in (half, swapped):  # masters and both moments as loaded, bit for bit
            assert all(torch.equal(x, y) for mine, it in zip(optimizer_state(e), state) for x, y in zip(mine, it))
        resumed = [[e.train_step(s) for s in range(SPLIT, STEPS)] for e in (memory, half, swapped)]
    finally:
        for e in (memory, half, swapped):
            e.close()
    assert resumed[1] == resumed[2] == resumed[0]
    assert rel_close(resumed[0], ref[SPLIT:], 1e-5), (resumed[0], ref[SPLIT:])
    assert list(swap.iterdir()) == []


def _at(tree: Any, dotted: str) -> torch.Tensor:
    """The tensor at a manifest name (``optimizer.exp_avg.layers.0.ln1.weight``) of a loaded state tree."""
    node, rest = tree, dotted
    while not isinstance(node, torch.Tensor):
        key = next(k for k in sorted(node, key=len, reverse=True) if rest == k or rest.startswith(k + "."))
        node, rest = node[key], rest[len(key) + 1 :]
    return node
