"""An asynchronous checkpoint through a writer *process* (``CheckpointManager(async_save=True, mode="process")``)
streams NVMe-offloaded state too: the swap files are copied on disk and the writer process reads the copies
itself, block by block, checked against the CRCs the records had when copied. Neither process stages the state
(it was staged whole in the training process before); the checkpoint is the synchronous save's, bit for bit, and
holds the state as of the save while training rewrites the tiers; a corrupt copy fails the save naming the file,
the sub-group and the part, commits nothing and leaves no copy behind."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
from offload_helpers import PeakRss

import ucp
from training import Engine
from training.models.gpt import GPTConfig
from training.offload import OffloadConfig

MODEL = GPTConfig(vocab_size=1000, n_layer=4, n_head=4, d_model=256, d_ff=1024, max_seq=32)  # 3.5M parameters
AIO = {"queue_depth": 4, "block_size": 1 << 20}
MIB = 1 << 20


def engine(path: Path, model: GPTConfig | str = MODEL, *, stage: int = 3) -> Engine:
    off: dict = {"offload_optimizer": {"device": "nvme", "nvme_path": str(path)}, "swap_budget": 8 << 20}
    if stage == 3:  # ZeRO-Infinity: the parameters on NVMe too
        off["offload_param"] = {"device": "nvme", "nvme_path": str(path), "buffer_size": 1 << 18, "buffer_count": 4}
    off["sub_group_size"] = 65536 if model == "tiny" else 262144
    return Engine(model, offload=OffloadConfig.model_validate(off), micro_batch=2, lr=1e-3, zero_stage=stage)


def process_manager(root: Path) -> ucp.CheckpointManager:
    return ucp.CheckpointManager(root, async_save=True, mode="process", aio_config=AIO)


def tiers(e: Engine) -> list[torch.Tensor]:
    """Every offloaded tensor: each group's master and moments, and the parameters' partitions."""
    assert e.optimizer.offload is not None and e.optimizer.param_tier is not None
    out = [t.clone() for g in range(len(e.optimizer.plans)) for t in e.optimizer.offload.gather_group(g)]
    try:
        return out + [t.clone() for t in e.optimizer.param_tier.stage()]
    finally:
        e.optimizer.param_tier.drop_staged()


def copies_gone(e: Engine) -> bool:
    """Whether the copies of the swap files a save made are removed (by the save handle's done-callback)."""
    assert e.optimizer.offload is not None
    swap = Path(e.optimizer.offload.describe()["dir"]).parent
    deadline = time.monotonic() + 10
    while list(swap.rglob("checkpoint-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not list(swap.rglob("checkpoint-*"))


def same(a: object, b: object) -> None:
    """Assert two loaded state trees are equal, tensors bit for bit."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def peak_of(pid: int) -> int:
    """Reset process ``pid``'s peak RSS; its RSS now (bytes)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return _status(pid, "VmRSS")


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def test_a_process_mode_save_streams_both_tiers_and_writes_the_sync_checkpoint(tmp_path: Path) -> None:
    a = engine(tmp_path)
    sync, later = ucp.CheckpointManager(tmp_path / "sync", aio_config=AIO), process_manager(tmp_path / "async")
    try:
        a.train_step(0)
        state = sum(3 * 4 * plan.size for plan in a.optimizer.plans)  # masters and moments: 42 MiB
        a.save(sync)
        assert later.saver is not None
        pid = later.saver.start()
        assert pid is not None
        child = peak_of(pid)
        with PeakRss() as saving:
            handle = a.save(later)
            assert isinstance(handle, ucp.SaveHandle)
            handle.result()
        child_extra = _status(pid, "VmHWM") - child
        # neither process staged the state: the writer read it block by block (3 sub-group parts, 3 MiB)
        assert saving.extra <= 8 * MIB, f"the trainer added {saving.extra / MIB:.1f} MiB for {state / MIB:.0f} MiB"
        assert child_extra <= 16 * MIB, f"the writer added {child_extra / MIB:.1f} MiB for {state / MIB:.0f} MiB"
        assert copies_gone(a)
        ours, theirs = ucp.read_manifest(later.path(1)), ucp.read_manifest(sync.path(1))
        assert ours.tensors.keys() == theirs.tensors.keys()
        for name, entry in theirs.tensors.items():  # the same pieces, the same bytes (their CRC-32Cs)
            pieces = {(repr(p.region()), p.length, p.crc32c) for p in entry.pieces}
            assert {(repr(p.region()), p.length, p.crc32c) for p in ours.tensors[name].pieces} == pieces, name
        same(ucp.load(later.path(1)), ucp.load(sync.path(1)))

        a.train_step(1)
        at_two = tiers(a)
        handle = a.save(later)  # step 2: read by the writer process while step 2 rewrites every swap file
        a.train_step(2)
        handle.result()
        assert not torch.equal(tiers(a)[0], at_two[0])  # the tier moved on under the save
        assert a.load(later) == 2
        assert all(torch.equal(x, y) for x, y in zip(tiers(a), at_two))  # as of the save, bit for bit
    finally:
        a.close()
        later.close()
    assert ucp.verify(later.path(2)).ok


def test_a_corrupt_copy_fails_a_process_mode_save_naming_file_sub_group_and_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.offload import checkpoint

    def corrupting(src: Path, dst: Path) -> int:
        n = real(src, dst)
        if not hit:  # the first swap file copied (sub-groups kept in memory have none)
            hit.append(int(dst.name.split("-")[1]))
            with open(dst, "r+b") as f:
                os.pwrite(f.fileno(), b"\x7f" * 16, 64)  # inside its master
        return n

    hit: list[int] = []

    real = checkpoint.copy_file
    monkeypatch.setattr(checkpoint, "copy_file", corrupting)
    e = engine(tmp_path, "tiny", stage=1)
    m = process_manager(tmp_path / "ckpt")
    try:
        e.train_step(0)
        handle = e.save(m)
        assert isinstance(handle, ucp.SaveHandle)
        with pytest.raises(ucp.CorruptCheckpointError) as err:
            handle.result()
        k = hit[0]
        assert re.search(
            rf"checkpoint-\w+/subgroup-{k:05d}\S* \(copy of the swap file of sub-group {k} .*: its master\) is corrupt",
            str(err.value),
        ), str(err.value)
        assert m.latest() is None  # nothing committed
        assert copies_gone(e)
    finally:
        e.close()
        m.close()
