"""The two ranks of tests/training/test_training_run_and_resume.py: a resume from a checkpoint that one
rank finds corrupt (every rank must fall back to the same step), and a pp 2 save and resume; each rank
writes what it saw to OUT/<scenario>.rank<R>.json.

usage: python training_run_and_resume_worker.py RANK WORLD INIT_FILE OUT_DIR SCENARIOS_JSON
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from training_helpers import BASE, GQA, PLAIN
from world import serve_scenarios

import ucp
from training import Engine
from training.models.gpt import GPTConfig

# Global batch of 4 rows everywhere; one process trains with micro_batch 4.
ONE = {**BASE, "micro_batch": 4}


def engine(model: dict = GQA, mesh: dict[str, int] | None = None, **options: Any) -> Engine:
    return Engine(GPTConfig(**model), mesh=mesh or {}, **{**ONE, **options})


def save_at(e: Engine, root: Path, steps: int) -> ucp.CheckpointManager:
    """Train ``e`` to ``steps`` and save it there with a synchronous manager."""
    while e.step < steps:
        e.train_step()
    manager = ucp.CheckpointManager(root)
    e.save(manager)
    return manager


# -- the worker side (two ranks) --------------------------------------------------------------------


def run_corrupt(sc: dict, rank: int) -> dict[str, Any]:
    """dp 2 ZeRO-1 saves steps 1 and 2; a byte that only rank 1 reads is flipped in step 2; both ranks resume."""
    import torch.distributed as dist

    root = Path(sc["root"])
    e = engine(PLAIN, {"dp": 2}, zero_stage=1, micro_batch=2)
    manager = ucp.CheckpointManager(root)
    for _ in range(2):
        e.train_step()
        e.save(manager)
    dist.barrier()
    if rank == 0:
        path = Path(manager.path(2))
        manifest = ucp.read_manifest(path)
        piece = next(
            p
            for name, t in manifest.tensors.items()
            if name.startswith("optimizer.exp_avg_sq.")
            for p in t.pieces
            if p.file == "rank-00001.safetensors" and p.length >= 8
        )
        with open(path / piece.file, "r+b") as f:  # bit rot in rank 1's own optimizer partition
            f.seek(piece.offset + piece.length // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    fresh = engine(PLAIN, {"dp": 2}, zero_stage=1, micro_batch=2)
    resumed = ucp.CheckpointManager(root)
    start = fresh.load(resumed)
    return {"start": start, "adam_step": fresh.optimizer.adam_step, "loaded_step": resumed.loaded_step}


def run_pp2(sc: dict, rank: int) -> dict[str, Any]:
    """pp 2 (tied embedding on both stages) saves step 3 asynchronously and trains on; then resumes a dp 1 checkpoint."""
    opts = {"zero_stage": 1, "micro_batch": 2, "grad_accum": 2}
    e = engine(GQA, {"pp": 2}, **opts)
    losses = [e.train_step() for _ in range(3)]
    manager = ucp.CheckpointManager(sc["root"], async_save=True, snapshot="background")
    try:
        e.save(manager)
        losses += [e.train_step() for _ in range(3, 6)]
    finally:
        manager.close()
    f = engine(GQA, {"pp": 2}, **opts)
    start = f.load(ucp.CheckpointManager(sc["from_dp1"]))
    resumed = [f.train_step() for _ in range(start, 6)]
    return {"losses": losses, "resumed": resumed, "start": start, "adam_step": f.optimizer.adam_step}


def run_scenario(sc: dict, rank: int, world: int, out: Path) -> None:
    result = {"corrupt": run_corrupt, "pp2": run_pp2}[sc["action"]](sc, rank)
    (out / f"{sc['name']}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    serve_scenarios(run_scenario)
