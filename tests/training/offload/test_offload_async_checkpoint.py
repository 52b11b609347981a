"""An asynchronous checkpoint of NVMe-offloaded optimizer state streams too: the swap files are copied on disk
(in the kernel) and the writer thread reads the copy part by part, so the save adds a few MiB of peak RSS for a
state many times the pool's budget (it staged the whole state before); training goes on while it is written,
and the checkpoint holds the state as of the save, bit for bit; a copy that cannot be read back fails the save
naming the file, the sub-group and the part."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from offload_helpers import PeakRss

import ucp
from training import Engine
from training.models.gpt import GPTConfig
from training.offload import OffloadConfig, OffloadError

MODEL = GPTConfig(vocab_size=1000, n_layer=4, n_head=4, d_model=256, d_ff=1024, max_seq=32)  # 3.5M parameters
BUDGET = 8 << 20  # the swap pool's budget: the state is 42 MiB, five times it
AIO = {"queue_depth": 4, "block_size": 1 << 20}
MIB = 1 << 20


def engine(path: Path, model: GPTConfig | str = MODEL) -> Engine:
    small = model == "tiny"  # 0.85M parameters, 13 sub-groups of 64Ki elements
    off = {
        "offload_optimizer": {"device": "nvme", "nvme_path": str(path)},
        "sub_group_size": 65536 if small else 262144,
    }
    # every sub-group in a swap file (resident ones: test_offload_resident.py)
    config = OffloadConfig.model_validate({**off, "swap_budget": BUDGET, "keep_resident": False})
    return Engine(model, offload=config, micro_batch=2, lr=1e-3)


def manager(root: Path) -> ucp.CheckpointManager:
    return ucp.CheckpointManager(root, async_save=True, snapshot="sync", aio_config=AIO)


def tier(e: Engine) -> list[tuple[torch.Tensor, ...]]:
    assert e.optimizer.offload is not None
    return [e.optimizer.offload.gather_group(g) for g in range(len(e.optimizer.plans))]


def test_an_async_save_streams_a_copy_of_the_swap_files_while_training_goes_on(tmp_path: Path) -> None:
    a = engine(tmp_path)
    m = manager(tmp_path / "ckpt")
    try:
        a.train_step(0)
        state = sum(3 * 4 * plan.size for plan in a.optimizer.plans)
        weights = sum(p.numel() * p.element_size() for p in a.model.parameters())
        assert state >= 5 * BUDGET
        with PeakRss() as saving:
            handle = a.save(m)
            assert isinstance(handle, ucp.SaveHandle)
            handle.result()
        # the model's weights are copied (they are in memory); the offloaded state is not staged
        assert saving.extra <= weights + 8 * MIB, (
            f"the save added {saving.extra / MIB:.1f} MiB for {state / MIB:.1f} MiB of state"
        )
        swap = Path(a.optimizer.offload.describe()["dir"])
        deadline = time.monotonic() + 10
        while list(swap.glob("checkpoint-*")) and time.monotonic() < deadline:  # the handle's done-callback
            time.sleep(0.05)
        assert not list(swap.glob("checkpoint-*"))  # the copy is removed once the save is done

        a.train_step(1)
        at_two = tier(a)
        handle = a.save(m)  # step 2: written while step 2 trains and rewrites every swap file
        loss = a.train_step(2)
        handle.result()
        assert not torch.equal(tier(a)[0][0], at_two[0][0])  # the tier moved on under the save
        assert a.load(m) == 2
        for mine, theirs in zip(tier(a), at_two):  # masters and both moments, as of the save, bit for bit
            assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
        assert a.train_step(2) == loss
    finally:
        a.close()
        m.close()
    assert ucp.verify(ucp.CheckpointManager(tmp_path / "ckpt").path(2)).ok


def test_a_corrupt_copy_fails_the_save_naming_file_sub_group_and_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.offload import checkpoint

    def corrupting(src: Path, dst: Path) -> int:
        n = real(src, dst)
        if "subgroup-00003" in dst.name:
            with open(dst, "r+b") as f:
                os.pwrite(f.fileno(), b"\x7f" * 16, 64)  # inside its master
        return n

    real = checkpoint.copy_file
    monkeypatch.setattr(checkpoint, "copy_file", corrupting)
    e = engine(tmp_path, "tiny")
    m = manager(tmp_path / "ckpt")
    try:
        e.train_step(0)
        handle = e.save(m)
        with pytest.raises(
            OffloadError, match=r"copy of the swap file .*subgroup-00003.* of sub-group 3 .*corrupt: .* of its master"
        ):
            handle.result()
        assert m.latest() is None  # nothing committed
    finally:
        e.close()
        m.close()
