"""Checkpoints of parameters on NVMe (``offload_param: nvme``, ZeRO-3) stream them: a save reads each piece of the
compute-dtype partitions from its swap file chunk by chunk through the tier's pool, a load writes the loaded
masters' casts into the tier the same way, so neither adds more than a few MiB of peak RSS (they staged every
partition before, twice on a load); the loaded weights are the saved ones bit for bit; a corrupt parameter swap
file fails the save naming the file and the parameter's partition."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from offload_helpers import PeakRss, scribble

import ucp
from training import Engine
from training.models.gpt import GPTConfig
from training.offload import OffloadConfig, OffloadError

MODEL = GPTConfig(vocab_size=1000, n_layer=4, n_head=4, d_model=256, d_ff=1024, max_seq=32)  # 3.5M parameters
AIO = {"queue_depth": 4, "block_size": 1 << 20}  # the checkpoint writer's and loader's own staging: 4 MiB at most
MIB = 1 << 20


def engine(path: Path, optimizer: str, model: GPTConfig | str = MODEL) -> Engine:
    off = {
        "offload_param": {"device": "nvme", "nvme_path": str(path), "buffer_size": 1 << 18, "buffer_count": 4},
        "offload_optimizer": {"device": optimizer, "nvme_path": str(path)},
        "sub_group_size": 262144,
        "swap_budget": 8 << 20,
    }
    return Engine(model, offload=OffloadConfig.model_validate(off), micro_batch=2, lr=1e-3, zero_stage=3)


def manager(root: Path) -> ucp.CheckpointManager:
    return ucp.CheckpointManager(root, aio_config=AIO)


def partitions(e: Engine) -> list[torch.Tensor]:
    assert e.optimizer.param_tier is not None
    try:
        return [t.clone() for t in e.optimizer.param_tier.stage()]
    finally:
        e.optimizer.param_tier.drop_staged()


def masters(e: Engine) -> list[torch.Tensor]:
    if e.optimizer.offload is None:
        return list(e.optimizer.master)
    return [e.optimizer.offload.gather_group(g)[0] for g in range(len(e.optimizer.plans))]


def test_saves_and_loads_stream_the_parameter_tier_sync_and_async(tmp_path: Path) -> None:
    # both tiers on NVMe (ZeRO-Infinity); with the optimizer in memory the same streaming is resumed and compared
    # by tests/training/offload/test_offload_params.py::test_checkpoints_move_between_param_offload_on_and_off
    sync, later = (
        manager(tmp_path / "sync"),
        ucp.CheckpointManager(tmp_path / "async", async_save=True, snapshot="sync", aio_config=AIO),
    )
    a, b = engine(tmp_path, "nvme"), engine(tmp_path, "nvme")
    try:
        a.train_step(0)
        weights = 4 * sum(plan.size for plan in a.optimizer.plans)  # this rank's fp32 partitions: 14 MiB
        with PeakRss() as saving:
            a.save(sync)
        assert saving.extra <= weights / 2, f"the save added {saving.extra / MIB:.1f} MiB for {weights / MIB:.1f} MiB"
        with PeakRss() as loading:
            assert b.load(sync) == 1
        assert loading.extra <= weights / 2, f"the load added {loading.extra / MIB:.1f} MiB for {weights / MIB:.1f} MiB"
        assert all(torch.equal(x, y) for x, y in zip(partitions(b), partitions(a)))  # the weights, bit for bit
        assert all(torch.equal(x, y) for x, y in zip(masters(b), masters(a)))  # and what they are cast from
        assert b.optimizer.adam_step == a.optimizer.adam_step == 1

        # asynchronous: the parameters' and the optimizer's swap files copied on disk, then streamed
        with PeakRss() as saving:
            a.save(later).result()
        assert saving.extra <= weights / 2, f"the save added {saving.extra / MIB:.1f} MiB for {weights / MIB:.1f} MiB"
        a.train_step(1)
        at_two, masters_at_two = partitions(a), masters(a)
        handle = a.save(later)
        a.train_step(2)  # rewrites both tiers while the save streams their copies
        handle.result()
        assert not torch.equal(partitions(a)[0], at_two[0])  # the tier moved on under the save
        assert b.load(later) == 2
        assert all(torch.equal(x, y) for x, y in zip(partitions(b), at_two))  # as of the save, bit for bit
        assert all(torch.equal(x, y) for x, y in zip(masters(b), masters_at_two))
    finally:
        a.close()
        b.close()
        later.close()
    assert ucp.verify(sync.path(1)).ok and ucp.verify(later.path(2)).ok


def test_a_corrupt_parameter_swap_file_fails_the_save_naming_file_and_partition(tmp_path: Path) -> None:
    e = engine(tmp_path, "none", "tiny")
    try:
        e.train_step(0)
        tier = e.optimizer.param_tier
        assert tier is not None
        k = next(k for k in range(len(tier.offload.partitions)) if tier.offload.swapped(k))
        victim, name = tier.offload.path(k), tier.offload.partitions[k].name
        scribble(victim, 64)
        with pytest.raises(
            OffloadError, match=rf"swap file {victim} of parameter '{name}' \(partition 0 of 1.* is corrupt"
        ):
            e.save(manager(tmp_path / "ckpt"))
        assert manager(tmp_path / "ckpt").latest() is None  # nothing committed
    finally:
        e.close()
