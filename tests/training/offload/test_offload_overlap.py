"""The offloaded update overlapped with backward (ZeRO-3, no clipping): each sub-group is read, updated and
written back as soon as backward has finished its gradients, the next step's reads start behind forward,
and the losses and weights stay bit-equal to the in-memory run; a swap file corrupted while the reads run
ahead is still an OffloadError naming the file and the sub-group."""

from __future__ import annotations

import ctypes
import json
import mmap
from pathlib import Path
from typing import Any

import pytest
import torch
from offload_worker import weights_digest
from training_helpers import run_world

from training import Engine
from training.offload import OffloadConfig, OffloadError

SUB_GROUP = 65536  # elements: 768 KiB records; the tiny GPT's 0.85M parameters make 13 sub-groups
WORKER = Path(__file__).resolve().parents[2] / "support" / "offload_worker.py"
BUDGET = 4 << 20  # 5 slots of 768 KiB: far less than the 10 MiB of state
STEPS = 3
OPTIONS: dict[str, Any] = {"zero_stage": 3, "weight_decay": 0.1, "lr": 3e-3}


def config(device: str, path: Path | None) -> OffloadConfig:
    section: dict[str, Any] = {"device": device}
    if path is not None:
        section["nvme_path"] = str(path)
    return OffloadConfig.model_validate(
        {"offload_optimizer": section, "sub_group_size": SUB_GROUP, "swap_budget": BUDGET}
    )


def engine(off: OffloadConfig | None = None, **options: Any) -> Engine:
    return Engine("tiny", offload=off or OffloadConfig(), **{**OPTIONS, **options})


@pytest.fixture(scope="module")
def reference() -> dict[int, tuple[list[float], str]]:
    out = {}
    for accum in (1, 2):
        e = engine(grad_accum=accum)
        out[accum] = ([e.train_step(s) for s in range(STEPS)], weights_digest(e))
        NORMS[accum] = float(e.last_stats["grad_norm"])
        e.close()
    return out


NORMS: dict[int, float] = {}  # the in-memory run's last gradient norm, per grad_accum


@pytest.mark.parametrize(("device", "accum"), [("nvme", 1), ("nvme", 2), ("cpu", 1)])
def test_update_during_backward_matches_in_memory_bit_for_bit(
    tmp_path: Path, reference: dict[int, tuple[list[float], str]], device: str, accum: int
) -> None:
    e = engine(config(device, tmp_path if device == "nvme" else None), grad_accum=accum)
    off = e.optimizer.offload
    assert off is not None and e.optimizer.can_update_early()
    try:
        losses, early = [], []
        for s in range(STEPS):
            losses.append(e.train_step(s))
            early.append(off.last["early"])
            off.wait_io()  # the next step's first reads are in before its forward (a tiny model's is quick)
        n = len(off.subgroups)
        # Backward hands the sub-groups over last layer first: the next steps read them in that order.
        assert off.order != list(range(n)) and sorted(off.order) == list(range(n))
        assert off.order.index(0) >= n // 2  # the embedding (and tied head) comes first, its gradient late
        if device == "nvme":
            tier = off.describe()
            assert tier["slots"] < n and tier["read_ahead"] == tier["slots"]  # the next step's reads: behind forward
            assert off.last["bytes_read"] == off.last["bytes_written"] > 0
            assert tier["pinned_bytes"] == 0 and 0 < tier["host_bytes"] <= BUDGET  # no GPU here: nothing pinned
            # From the second step the reads run in backward's order: at least the pool's worth of sub-groups
            # read ahead is updated during backward, as backward hands them over.
            assert min(early[1:]) >= tier["slots"], early
            assert off.last["early_compute"] > 0
        else:
            assert all(x == n for x in early)  # the CPU tier's records are always in
        # Each sub-group's gradient was zeroed (its pages given back) once the tier had updated it.
        assert all(not acc.any() for acc in e.optimizer.grad_acc)
        # The norm's terms were taken during backward, summed in another order: equal to rounding.
        assert e.last_stats["grad_norm"] == pytest.approx(NORMS[accum], rel=1e-12)
    finally:
        e.close()
    assert (losses, weights_digest(e)) == reference[accum]


def test_clipping_keeps_the_update_in_step(tmp_path: Path) -> None:
    e = engine(config("nvme", tmp_path), clip=1.0)
    try:
        assert not e.optimizer.can_update_early()  # the clip coefficient needs every gradient first
        e.train_step(0)
        assert e.optimizer.offload is not None and e.optimizer.offload.last["early"] == 0
    finally:
        e.close()


def test_swap_file_corrupted_while_reads_run_ahead_names_file_and_sub_group(tmp_path: Path) -> None:
    e = engine(config("nvme", tmp_path))
    off = e.optimizer.offload
    assert off is not None
    try:
        e.train_step(0)
        off.wait_io()  # the first reads of step 1 are in; the rest are issued as backward frees their slots
        slots = off.describe()["slots"]
        victim_index = off.order[slots + 1]
        victim = off.store.path(off.subgroups[victim_index])
        with open(victim, "r+b") as f:
            f.seek(4096)
            byte = f.read(1)
            f.seek(4096)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(
            OffloadError, match=rf"swap file {victim} of sub-group {victim_index} \(group \d+, .*corrupt"
        ):
            e.train_step(1)
        # Sub-groups were updated before the error: the tier is partly updated, and says so.
        with pytest.raises(OffloadError, match=r"an earlier optimizer step failed half way \(OffloadError: swap file"):
            e.train_step(1)
    finally:
        e.close()


def test_two_ranks_zero3_update_during_backward_matches_in_memory(tmp_path: Path) -> None:
    swap = tmp_path / "nvme"
    swap.mkdir()
    model = {"vocab_size": 512, "n_layer": 2, "n_head": 4, "d_model": 128, "d_ff": 512, "max_seq": 32}
    base = {"model": model, "mesh": {"dp": 2}, "options": {**OPTIONS, "micro_batch": 2}, "steps": STEPS}
    nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}, "sub_group_size": 16384}
    scenarios = [{**base, "name": "z3", "offload": None}, {**base, "name": "z3_nvme", "offload": nvme}]
    run_world(2, scenarios, tmp_path, timeout=300, worker=WORKER)
    for rank in (0, 1):
        ref, got = (json.loads((tmp_path / f"{n}.rank{rank}.json").read_text()) for n in ("z3", "z3_nvme"))
        assert got["losses"] == ref["losses"] and got["digest"] == ref["digest"], rank
        assert got["last"]["early"] > 0  # the reduce-scattered gradients were handed over during backward
        assert got["tier"]["subgroups"] > got["tier"]["slots"]


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s storage resident in memory (mincore), the partial pages at its ends included."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    hi = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    assert libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_single_pass_step_never_faults_the_gradient_partition_back_in(tmp_path: Path, device: str) -> None:
    """Without accumulation the armed pass uses each parameter's reduced gradient as it came: the fp32 gradient
    partition stays given back through backward (adding into it faulted every page back in, every step)."""
    e = engine(config(device, tmp_path if device == "nvme" else None))
    off = e.optimizer.offload
    assert off is not None
    seen: list[int] = []
    ready = off.ready

    def watch(indices: Any) -> None:
        seen.append(sum(_resident_pages(acc) for acc in e.optimizer.grad_acc))  # as backward hands them over
        ready(indices)

    off.ready = watch
    try:
        e.train_step(0)  # the first step gives back the pages the start-up zeroing made resident
        seen.clear()
        e.train_step(1)
        assert seen and max(seen) <= 2 * len(e.optimizer.grad_acc), seen  # at most each partition's end pages
    finally:
        e.close()
