"""A rank is SIGKILLed while a checkpoint is being saved: the others must not hang, and a resume picks the last
complete checkpoint.

Two gloo processes train the GQA test model with a ``ucp.CheckpointManager`` (sync or async): they save
step K and wait for it, train step K, then save step K+1 — and the victim rank kills itself (SIGKILL,
from inside, so the moment is deterministic) right after the first write into its data file of the step-
K+1 save (a patched ``LocalStorage.open_writer``; on the async writer thread for async saves). The
survivor then tries to finish the save, wait for it and train on; the save must fail, and it must exit
within a bound (the test kills the group otherwise and says where it hung). Sync saves fail at once
(gloo sees the peer's connection reset). Async saves commit through files, without collectives: the
survivor's writer sees the dead rank's liveness lock released and fails at once, with the default
``commit_timeout`` (1800 s) left as it is — a hang here would be caught by the bound. Then a fresh engine on another
layout (one process, ZeRO-0) resumes through ``engine.load(manager)``: it must load step K, the
step-K+1 leftovers are never listed as complete, and its losses are an uninterrupted run's.

The ranks run tests/support/training_kill_worker.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from repo_paths import SUPPORT
from training_helpers import GQA, rel_close
from training_kill_worker import DP1, STEPS, SURVIVOR_BOUND, WORKER_DEADLINE, WORLD, K
from world import start_world

import ucp
from training import Engine
from training.models.gpt import GPTConfig

WORKER = SUPPORT / "training_kill_worker.py"


# -- the test side ---------------------------------------------------------------------------------


def launch(spec: dict, out: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """Start WORLD worker ranks; wait for the victim to die and the survivors to exit (bounded)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    init = out / "init"
    init.unlink(missing_ok=True)
    logs = [open(out / f"rank{r}.log", "w") for r in range(WORLD)]
    args = lambda r: [r, WORLD, init, out, out / "spec.json"]
    procs = start_world(WORKER, args, WORLD, logs=logs, start_new_session=True)
    victim = procs[spec["victim"]]
    hung: list[str] = []
    try:
        victim.wait(timeout=WORKER_DEADLINE)
        dead_at = time.monotonic()
        for r, p in enumerate(procs):
            try:
                p.wait(timeout=max(1.0, SURVIVOR_BOUND - (time.monotonic() - dead_at)))
            except subprocess.TimeoutExpired:
                hung.append(
                    f"rank {r} still running {SURVIVOR_BOUND:.0f}s after the victim died; "
                    f"last status: {_status(out, r)}"
                )
    except subprocess.TimeoutExpired:
        hung.append(f"the victim (rank {spec['victim']}) never died; statuses: {_status(out, 0)} {_status(out, 1)}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()
    return procs, hung


def _status(out: Path, rank: int) -> dict[str, Any]:
    try:
        return json.loads((out / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    e = Engine(GPTConfig(**GQA), mesh={}, **DP1)
    return [e.train_step() for _ in range(STEPS)]


@pytest.mark.parametrize("mode,victim", [("sync", 1), ("async", 1), ("async", 0), ("sync", 0)])
def test_rank_killed_mid_save(tmp_path: Path, uninterrupted: list[float], mode: str, victim: int) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "run"
    spec = {"async": mode == "async", "victim": victim, "root": str(root), "out": str(out)}
    procs, hung = launch(spec, out)
    logs = "\n".join(f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text()[-3000:]}" for r in range(WORLD))

    assert (out / "victim.killing").exists(), f"the victim never reached the step-{K + 1} write\n{logs}"
    assert procs[victim].returncode == -signal.SIGKILL, logs
    assert not hung, "\n".join(hung) + "\n" + logs
    survivor = _status(out, 1 - victim)
    assert survivor.get("closed"), f"the survivor did not get through manager.close(): {survivor}\n{logs}"
    # Step K+1 cannot commit without the victim: the survivor's save (sync: a gloo collective sees the
    # connection reset at once; async: the file-based commit sees the victim's liveness lock gone) raises.
    assert survivor.get("where") in ("saving K+1", "waiting for K+1"), survivor
    if mode == "async":
        assert "died" in survivor.get("error", ""), survivor

    manager = ucp.CheckpointManager(root)
    entries = manager.list()
    assert manager.latest() == K, entries
    assert [i.step for i in entries if i.status == "complete"] == [K], entries
    assert all(i.status in ("temp", "old") for i in entries if i.step == K + 1), entries

    e = Engine(GPTConfig(**GQA), mesh={}, **DP1)
    start = e.load(manager)
    assert start == K and manager.loaded_step == K and e.optimizer.adam_step == K
    resumed = [e.train_step() for _ in range(K, STEPS)]
    assert rel_close(resumed, uninterrupted[K:], 1e-5), (resumed, uninterrupted)

    # the next save of the fresh run cleans the leftovers up and commits
    e.save(manager)
    assert [(i.step, i.status) for i in manager.list()] == [(K, "complete"), (STEPS, "complete")]
