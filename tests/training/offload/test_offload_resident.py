"""The NVMe tier keeps whole sub-groups resident where the swap budget holds more than the pool's pipeline slots
(``keep_resident``) or where ``offload_optimizer.ratio`` < 1 asks for it: those never touch the disk, every step
moves only the rest, the losses stay bit-equal to the in-memory run (with the update during backward), and the
checkpoint path (sync and asynchronous saves, loads into tiers with another residency or none) handles them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from offload_helpers import optimizer_state as tier
from offload_worker import weights_digest

import ucp
from training import Engine
from training.models.gpt import GPTConfig
from training.offload import OffloadConfig, OffloadError

MODEL = GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=192, d_ff=768, max_seq=32)  # 1.1M parameters
SUB_GROUP = 65536  # elements: 768 KiB per record; 18 sub-groups (12.4 MiB of state), the first a small one (biases)
BUDGET = 4 << 20  # two 768 KiB pipeline slots, and four sub-groups resident (the small one and three whole)
OPTIONS: dict[str, Any] = {"micro_batch": 2, "lr": 1e-3, "zero_stage": 3, "clip": None, "dtype": "fp32"}
STEPS = 3


def config(path: Path | None, budget: int | None | str = "default", **optimizer: Any) -> OffloadConfig:
    if path is None:
        return OffloadConfig()
    keep = optimizer.pop("keep_resident", True)
    budget = BUDGET if budget == "default" else budget
    section = {"device": "nvme", "nvme_path": str(path), **optimizer}
    return OffloadConfig.model_validate(
        {"offload_optimizer": section, "sub_group_size": SUB_GROUP, "swap_budget": budget, "keep_resident": keep}
    )


def build(path: Path | None, **kw: Any) -> Engine:
    return Engine(MODEL, offload=config(path, **kw), **OPTIONS)


@pytest.fixture(scope="module")
def in_memory() -> tuple[list[float], str]:
    e = build(None)
    try:
        return [e.train_step(s) for s in range(STEPS)], weights_digest(e)
    finally:
        e.close()


@pytest.mark.parametrize("pipelined", [True, False])
def test_spare_budget_keeps_sub_groups_resident_and_each_step_moves_only_the_rest(
    tmp_path: Path, in_memory: tuple[list[float], str], pipelined: bool
) -> None:
    e = build(tmp_path, pipeline_read=pipelined, pipeline_write=pipelined)
    off = e.optimizer.offload
    assert off is not None
    try:
        losses = [e.train_step(s) for s in range(STEPS)]
        shape = off.describe()
        state = 12 * sum(p.size for p in e.optimizer.plans)
        assert state >= 2 * BUDGET
        assert shape["slots"] == 2 and shape["resident"] == 4
        assert shape["host_bytes"] == shape["pool_bytes"] + shape["resident_bytes"] <= BUDGET
        resident = [sg for sg in off.subgroups if off.store.is_resident(sg)]
        assert [sg.index for sg in resident] == [0, 1, 2, 3]  # the first parameters: handed over last in backward
        files = {p.name for p in Path(shape["dir"]).glob("subgroup-*.swp")}
        assert files == {off.store.path(sg).name for sg in off.subgroups if sg not in resident}
        swapped = shape["swapped_bytes"]
        assert swapped == sum(off.store.record_bytes(sg) for sg in off.subgroups) - shape["resident_bytes"]
        assert off.last["bytes_read"] == off.last["bytes_written"] == swapped  # the resident ones never move
        if pipelined:
            assert off.last["early"] >= 4  # updated during backward: a resident one as soon as its gradient is ready
    finally:
        e.close()
    assert (losses, weights_digest(e)) == in_memory


def test_keep_resident_off_swaps_every_sub_group(tmp_path: Path) -> None:
    e = build(tmp_path, keep_resident=False)
    try:
        off = e.optimizer.offload
        assert off is not None
        shape = off.describe()
        assert shape["resident"] == 0 and shape["slots"] == 4  # buffer_count 12 // 3, the budget holds 5
        assert shape["host_bytes"] == shape["pool_bytes"] <= BUDGET
        assert shape["swapped_bytes"] == sum(off.store.record_bytes(sg) for sg in off.subgroups)
    finally:
        e.close()


def test_ratio_keeps_the_rest_of_the_sub_groups_resident(tmp_path: Path, in_memory: tuple[list[float], str]) -> None:
    # DeepSpeed's offload_optimizer.ratio: the fraction offloaded; no budget, so only the ratio decides
    e = build(tmp_path, budget=None, ratio=0.5)
    off = e.optimizer.offload
    assert off is not None
    try:
        n = len(off.subgroups)
        assert off.describe()["resident"] == n - n // 2
        losses = [e.train_step(s) for s in range(STEPS)]
        assert len(list(Path(off.describe()["dir"]).glob("subgroup-*.swp"))) == n // 2
    finally:
        e.close()
    assert (losses, weights_digest(e)) == in_memory


def test_ratio_that_the_budget_cannot_hold_is_an_error_naming_both(tmp_path: Path) -> None:
    with pytest.raises(
        OffloadError,
        match=r"swap_budget 4 MiB holds not the 9 sub-groups ratio 0\.5 keeps resident \(6\.07 MiB\) and one sub-group",
    ):
        build(tmp_path, ratio=0.5).close()
    assert not list(tmp_path.iterdir())  # no swap directory left behind


def test_checkpoints_of_resident_sub_groups_load_into_any_tier(tmp_path: Path) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    a = build(tmp_path / "a")
    b = build(tmp_path / "b", keep_resident=False)
    c = build(None)
    try:
        for s in range(2):
            a.train_step(s)
        at_two = tier(a)
        later = ucp.CheckpointManager(tmp_path / "async", async_save=True, snapshot="sync")
        handle = a.save(later)  # asynchronous: the resident records go to the copy, then step 2 changes them
        loss = a.train_step(2)
        handle.result()
        assert not torch.equal(tier(a)[1][0], at_two[1][0])
        for e in (b, a):  # into a tier with every sub-group swapped, and back into the resident one
            assert e.load(later) == 2
            for mine, theirs in zip(tier(e), at_two):  # masters and both moments, as of the save, bit for bit
                assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
            assert e.train_step(2) == loss
        sync = ucp.CheckpointManager(tmp_path / "sync")
        a.save(sync)  # synchronous: the resident parts are read from memory
        assert c.load(sync) == 3
        assert all(torch.equal(x, y) for mine, theirs in zip(tier(c), tier(a)) for x, y in zip(mine, theirs))
        assert c.train_step(3) == a.train_step(3)
    finally:
        for e in (a, b, c):
            e.close()
