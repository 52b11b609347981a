"""One rank of the resume runs in tests/training/test_training_resume.py: train, save through a
CheckpointManager at step SPLIT, or load it on another mesh and train on; rank 0 writes the losses.

usage: python training_resume_worker.py RANK WORLD INIT_FILE OUT_DIR SCENARIOS_JSON
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training_helpers import BASE, GQA
from world import serve_scenarios

import ucp
from training import Engine
from training.models.gpt import GPTConfig

SPLIT, STEPS = 3, 6
# Global batch 4 rows on every mesh: micro_batch 2 at dp 2, 4 at dp 1.
DP2 = {**BASE, "micro_batch": 2}
DP1 = {**BASE, "micro_batch": 4}


def engine(mesh: dict[str, int], **options: Any) -> Engine:
    return Engine(GPTConfig(**GQA), mesh=mesh, **options)


# -- the worker side ---------------------------------------------------------------------------------


def run_save(sc: dict) -> list[float]:
    """Train steps 0..SPLIT-1, save step SPLIT; an async save keeps training while it is written."""
    e = engine(sc["mesh"], **sc["options"])
    losses = [e.train_step() for _ in range(SPLIT)]
    # the async save copies in the background while the next steps' forward/backward run
    manager = ucp.CheckpointManager(sc["root"], async_save=sc.get("async", False), snapshot=sc.get("snapshot", "sync"))
    try:
        e.save(manager, SPLIT)
        losses += [e.train_step() for _ in range(SPLIT, STEPS)]  # changes the live pieces the save viewed
    finally:
        manager.close()
    return losses


def run_load(sc: dict) -> list[float]:
    e = engine(sc["mesh"], **sc["options"])
    start = e.load(ucp.CheckpointManager(sc["root"]))
    assert start == SPLIT and e.optimizer.adam_step == SPLIT, (start, e.optimizer.adam_step)
    return [e.train_step() for _ in range(start, STEPS)]


def run_scenario(sc: dict, rank: int, world: int, out: Path) -> None:
    losses = run_save(sc) if sc["action"] == "save" else run_load(sc)
    if rank == 0:
        (out / f"{sc['name']}.losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    serve_scenarios(run_scenario)
