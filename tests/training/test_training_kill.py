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

This file is also the worker (``python test_training_kill.py RANK WORLD INIT OUT SPEC``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from training_helpers import BASE, GQA, rel_close

import ucp
from training import Engine
from training.models.gpt import GPTConfig

K = 2  # the checkpoint that completes; the save of K+1 is killed
STEPS = K + 2
WORLD = 2
DP2 = {**BASE, "micro_batch": 2, "zero_stage": 2}
DP1 = {**BASE, "micro_batch": 4, "zero_stage": 0}  # the same global batch of 4 rows
SURVIVOR_BOUND = 90.0  # seconds the survivor may take to give up once the victim is dead
WORKER_DEADLINE = 240.0


# -- the worker side ---------------------------------------------------------------------------------


def install_kill_hook(rank: int, spec: dict) -> None:
    """On the victim rank: SIGKILL this process right after the first write into the data file of step K+1."""
    if rank != spec["victim"]:
        return
    from ucp.manager import step_name
    from ucp.store.storage import LocalStorage

    marker = f".{step_name(K + 1)}.tmp-"
    real_open = LocalStorage.open_writer
    out = Path(spec["out"])

    class Killer:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def write(self, *args: Any, **kwargs: Any) -> Any:
            result = self.inner.write(*args, **kwargs)
            (out / "victim.killing").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
            return result

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    def open_writer(self: LocalStorage, rel: str, size_hint: int) -> Any:
        writer = real_open(self, rel, size_hint)
        return Killer(writer) if marker in rel else writer

    LocalStorage.open_writer = open_writer  # type: ignore[method-assign]


def worker(rank: int, world: int, init: str, out: Path, spec: dict) -> None:
    """Train, save K (complete), train, save K+1 (the victim dies), then try to go on; record what happened."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=spec.get("gloo_timeout", 1800)),
    )
    install_kill_hook(rank, spec)
    status: dict[str, Any] = {"rank": rank, "phase": "train"}

    def record(**kw: Any) -> None:
        status.update(kw, t=time.monotonic())
        (out / f"rank{rank}.json").write_text(json.dumps(status))

    manager = ucp.CheckpointManager(spec["root"], keep_last=2, async_save=spec["async"])
    e = Engine(GPTConfig(**GQA), mesh={"dp": world}, **DP2)
    try:
        for _ in range(K):
            e.train_step()
        e.save(manager)
        manager.wait()
        record(phase="saved K")
        e.train_step()
        record(phase="saving K+1")
        e.save(manager)
        record(phase="waiting for K+1")
        manager.wait()
        record(phase="training after K+1")
        e.train_step()
        record(phase="done")
    except BaseException as exc:  # noqa: BLE001 - the survivor's error is what the test looks at
        record(error=f"{type(exc).__name__}: {exc}"[:2000], where=status["phase"], trace=traceback.format_exc()[-3000:])
    finally:
        record(closing=True)
        manager.close()
        record(closed=True)


# -- the test side ---------------------------------------------------------------------------------


def launch(spec: dict, out: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """Start WORLD ranks of this file; wait for the victim to die and the survivors to exit (bounded)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    init = out / "init"
    init.unlink(missing_ok=True)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    logs = [open(out / f"rank{r}.log", "w") for r in range(WORLD)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(WORLD), str(init), str(out), str(out / "spec.json")],
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        for r in range(WORLD)
    ]
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


if __name__ == "__main__":
    r, w, init_file, out_dir, spec_file = sys.argv[1:6]
    worker(int(r), int(w), init_file, Path(out_dir), json.loads(Path(spec_file).read_text()))
    sys.stdout.flush()
    os._exit(0)
