"""Optimizer offload trains exactly like the in-memory run: NVMe (swap files through aio, a byte-budgeted
pool far smaller than the state) and CPU tiers, one process and real 2-rank worlds at ZeRO-1/2/3."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from offload_worker import weights_digest
from training_helpers import run_world

from training import Engine
from training.models.gpt import GPTConfig
from training.offload import OffloadConfig

WORKER = Path(__file__).resolve().parents[2] / "support" / "offload_worker.py"

# 3.4M parameters: 39 MiB of fp32 master + moments (19.5 MiB per rank at dp=2), against an 8 MiB swap pool.
MODEL = {"vocab_size": 2048, "n_layer": 3, "n_head": 4, "d_model": 256, "d_ff": 1024, "max_seq": 32}
BUDGET = 8 << 20
SUB_GROUP = 131072  # elements: 1.5 MiB per sub-group record, so the pool holds 4 (buffer_count 12 // 3)
OPTIONS: dict[str, Any] = {"micro_batch": 2, "weight_decay": 0.1, "clip": 1.0, "lr": 3e-3}
STEPS = 3


def offload(device: str, path: Path | None, **optimizer: Any) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, **optimizer}
    if path is not None:
        section["nvme_path"] = str(path)
    # every sub-group swapped (no spare budget kept resident: test_offload_resident.py): the whole state streams
    return {"offload_optimizer": section, "sub_group_size": SUB_GROUP, "swap_budget": BUDGET, "keep_resident": False}


def train(config: dict[str, Any] | None, steps: int = STEPS, **options: Any) -> tuple[list[float], str, Engine]:
    off = OffloadConfig.model_validate(config) if config else OffloadConfig()
    engine = Engine(GPTConfig(**MODEL), offload=off, **{**OPTIONS, **options})
    losses = [engine.train_step(s) for s in range(steps)]
    return losses, weights_digest(engine), engine


def state_bytes(engine: Engine) -> int:
    return 12 * sum(p.size for p in engine.optimizer.plans)


@pytest.fixture(scope="module")
def in_memory() -> dict[str, tuple[list[float], str]]:
    out = {}
    for dtype in ("fp32", "bf16"):
        losses, digest, engine = train(None, dtype=dtype)
        engine.close()
        out[dtype] = (losses, digest)
    return out


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nvme_offload_matches_in_memory_bit_for_bit(
    tmp_path: Path, in_memory: dict[str, tuple[list[float], str]], pipelined: bool, dtype: str
) -> None:
    config = offload("nvme", tmp_path, pipeline_read=pipelined, pipeline_write=pipelined)
    losses, digest, engine = train(config, dtype=dtype)
    off = engine.optimizer.offload
    assert off is not None
    tier = off.describe()
    try:
        assert state_bytes(engine) >= 2 * BUDGET  # the state could not fit the pool: it really streams
        assert tier["slots"] == 4 and tier["subgroups"] > tier["slots"]
        assert tier["read_ahead"] == (4 if pipelined else 0)  # the next step's first reads: behind its forward
        if not pipelined:
            assert tier["write_behind"] == 0
        assert 0 < tier["pool_bytes"] <= BUDGET
        assert all(m.numel() == 0 for m in engine.optimizer.master + engine.optimizer.exp_avg)  # nothing in RAM
        files = sorted(Path(tier["dir"]).glob("subgroup-*.swp"))
        assert len(files) == tier["subgroups"] and all(f.stat().st_size % tier["alignment"] == 0 for f in files)
        moved = sum(f.stat().st_size for f in files)
        assert off.last["bytes_read"] == off.last["bytes_written"] == moved  # every sub-group, each way, per step
        assert moved >= state_bytes(engine)
        last = off.last
        assert set(last) == {
            "seconds",
            "bytes_read",
            "bytes_written",
            "read_wait",
            "write_wait",
            "compute",
            "io_read",
            "io_write",
            "early",
            "early_compute",
        }
        assert last["io_read"] > 0 and last["io_write"] > 0
        assert last["compute"] > 0 and last["seconds"] >= last["compute"]
        quantum = tier["alignment"] // 4  # sub-groups are cut at the I/O alignment, so Adam's chunks line up
        for sg in off.subgroups:
            assert sg.lo % quantum == 0 and (sg.numel % quantum == 0 or sg.hi == engine.optimizer.plans[sg.group].size)
    finally:
        engine.close()
    assert not Path(tier["dir"]).exists()  # the run's swap directory goes with the engine
    assert (losses, digest) == in_memory[dtype]


def test_cpu_offload_matches_in_memory_bit_for_bit(in_memory: dict[str, tuple[list[float], str]]) -> None:
    losses, digest, engine = train(offload("cpu", None))
    off = engine.optimizer.offload
    assert off is not None and off.device == "cpu"
    assert off.describe()["resident_bytes"] >= state_bytes(engine)
    assert all(m.numel() == 0 for m in engine.optimizer.master)
    assert off.last["bytes_read"] == off.last["bytes_written"] == 0  # nothing moves on the CPU tier
    engine.close()
    assert (losses, digest) == in_memory["fp32"]


def test_two_ranks_zero_1_2_3_offload_matches_in_memory(tmp_path: Path) -> None:
    swap = tmp_path / "nvme"
    swap.mkdir()
    scenarios = []
    for stage in (1, 2, 3):
        base = {"model": MODEL, "mesh": {"dp": 2}, "options": {**OPTIONS, "zero_stage": stage}, "steps": STEPS}
        scenarios.append({**base, "name": f"z{stage}", "offload": None})
        scenarios.append({**base, "name": f"z{stage}_nvme", "offload": offload("nvme", swap)})
    base = {"model": MODEL, "mesh": {"dp": 2}, "options": {**OPTIONS, "zero_stage": 2}, "steps": STEPS}
    scenarios.append({**base, "name": "z2_cpu", "offload": offload("cpu", None)})
    run_world(2, scenarios, tmp_path, timeout=300, worker=WORKER)

    def facts(name: str, rank: int) -> dict[str, Any]:
        return json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())

    for stage in (1, 2, 3):
        for rank in (0, 1):
            ref, nvme = facts(f"z{stage}", rank), facts(f"z{stage}_nvme", rank)
            assert nvme["losses"] == ref["losses"], (stage, rank)
            assert nvme["digest"] == ref["digest"], (stage, rank)
            assert nvme["state_bytes"] >= 2 * BUDGET and nvme["tier"]["pool_bytes"] <= BUDGET
            assert nvme["last"]["bytes_read"] > 0 and nvme["dir_removed"] is True
            assert math.isfinite(nvme["losses"][-1])
    for rank in (0, 1):
        assert facts("z2_cpu", rank)["digest"] == facts("z2", rank)["digest"]
    assert list(swap.iterdir()) == []  # every rank's swap directory is gone
