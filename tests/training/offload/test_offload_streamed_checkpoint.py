"""Saving and loading NVMe-offloaded optimizer state is streamed: the save reads the swap files part by part
into the swap pool's slots and hands each piece to the writer, the load fills the tier record by record, so
neither holds the state in memory (peak RSS grows by a few MiB for a state many times the pool's budget);
the round trip is bit-exact; a corrupt piece makes the manager fall back to an older checkpoint, a corrupt
swap file fails the save naming the file, sub-group and part."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from offload_helpers import PeakRss, scribble

import ucp
from training import Engine
from training.models.gpt import GPTConfig
from training.offload import OffloadConfig, OffloadError

MODEL = GPTConfig(vocab_size=1000, n_layer=4, n_head=4, d_model=256, d_ff=1024, max_seq=32)  # 3.5M parameters
BUDGET = 8 << 20  # the swap pool's budget: the state is 42 MiB, five times it
AIO = {"queue_depth": 4, "block_size": 1 << 20}  # the checkpoint writer's own staging: 4 MiB at most
MARGIN = 16 << 20  # what a save or load may add to the peak RSS here: the writer's or loader's staging, noise
MIB = 1 << 20


def config(path: Path, sub_group_size: int = 262144) -> OffloadConfig:
    return OffloadConfig.model_validate(
        {
            "offload_optimizer": {"device": "nvme", "nvme_path": str(path)},
            "sub_group_size": sub_group_size,
            "swap_budget": BUDGET,
            "keep_resident": False,  # every sub-group in a swap file (resident ones: test_offload_resident.py)
        }
    )


def engine(path: Path, model: GPTConfig | str = MODEL) -> Engine:
    small = model == "tiny"  # 0.85M parameters, 13 sub-groups of 64Ki elements
    return Engine(model, offload=config(path, 65536 if small else 262144), micro_batch=2, lr=1e-3)


def manager(root: Path) -> ucp.CheckpointManager:
    return ucp.CheckpointManager(root, aio_config=AIO)


def state_bytes(e: Engine) -> int:
    return sum(3 * 4 * plan.size for plan in e.optimizer.plans)


def tier(e: Engine) -> list[tuple[torch.Tensor, ...]]:
    assert e.optimizer.offload is not None
    return [e.optimizer.offload.gather_group(g) for g in range(len(e.optimizer.plans))]


def test_save_and_load_are_streamed_in_bounded_memory_and_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    a = engine(tmp_path)
    b = engine(tmp_path)
    try:
        a.train_step(0)
        state = state_bytes(a)
        assert state >= 5 * BUDGET
        with PeakRss() as saving:
            a.save(manager(root))
        assert saving.extra <= MARGIN, f"the save added {saving.extra / MIB:.1f} MiB for {state / MIB:.1f} MiB of state"
        io = a.last_checkpoint_io
        assert 0 < io["buffer_bytes"] <= BUDGET  # the pool's own slots
        assert state <= io["bytes_read"] < 1.25 * state  # each part read about once
        # into a tier that holds other values (the initial masters, zero moments), whose pool the load makes
        with PeakRss() as loading:
            assert b.load(manager(root)) == 1
        assert loading.extra <= BUDGET + MARGIN, (
            f"the load added {loading.extra / MIB:.1f} MiB for {state / MIB:.1f} MiB"
        )
        for mine, theirs in zip(tier(b), tier(a)):  # masters and both moments, bit for bit
            assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
        assert b.optimizer.adam_step == a.optimizer.adam_step == 1
        assert b.train_step(1) == a.train_step(1)
    finally:
        a.close()
        b.close()
    assert ucp.verify(ucp.CheckpointManager(root).path(1)).ok


def test_a_corrupt_optimizer_piece_falls_back_to_the_older_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    a = engine(tmp_path, "tiny")
    b = engine(tmp_path, "tiny")
    try:
        a.train_step(0)
        a.save(manager(root))
        older = tier(a)
        a.train_step(1)
        a.save(manager(root))
        path = Path(ucp.CheckpointManager(root).path(2))
        name = next(n for n in ucp.read_manifest(path).tensors if n.startswith("optimizer.exp_avg_sq."))
        piece = ucp.read_manifest(path).tensors[name].pieces[0]
        fd = os.open(path / piece.file, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x7f" * 8, piece.offset)
        finally:
            os.close(fd)
        assert b.load(manager(root)) == 1
        assert "trying an older checkpoint" in caplog.text and name in caplog.text
        for mine, theirs in zip(tier(b), older):
            assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
        with pytest.raises(ucp.CheckpointError, match=name):
            b.load(manager(root), step=2)
        assert b.optimizer.offload is not None and b.optimizer.offload.broken is not None  # partly rewritten
        assert b.load(manager(root), step=1) == 1  # a load makes the tier whole again
        assert b.optimizer.offload.broken is None
    finally:
        a.close()
        b.close()


def test_a_corrupt_swap_file_fails_the_save_naming_file_sub_group_and_part(tmp_path: Path) -> None:
    e = engine(tmp_path, "tiny")
    try:
        e.train_step(0)
        assert e.optimizer.offload is not None
        e.optimizer.offload.quiesce()
        victim = sorted(Path(e.optimizer.offload.describe()["dir"]).glob("subgroup-*.swp"))[3]
        stride = e.optimizer.offload.store.stride(e.optimizer.offload.subgroups[3])
        scribble(victim, stride + 64)  # inside exp_avg
        with pytest.raises(OffloadError, match=rf"swap file {victim} of sub-group 3 .*is corrupt: .* of its exp_avg,"):
            e.save(manager(tmp_path / "ckpt"))
        assert ucp.CheckpointManager(tmp_path / "ckpt").latest() is None  # nothing committed
    finally:
        e.close()
