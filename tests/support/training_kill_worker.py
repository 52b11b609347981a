"""One rank of tests/training/test_training_kill.py: train, save K, train, save K+1 while the victim rank
SIGKILLs itself right after its first write of that save; the survivor records in OUT/rank<R>.json how
far it got (and the error that stopped it).

usage: python training_kill_worker.py RANK WORLD INIT_FILE OUT_DIR SPEC_JSON
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from training_helpers import BASE, GQA
from world import init_gloo

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

    torch.set_num_threads(1)
    init_gloo(init, rank, world, timeout=timedelta(seconds=spec.get("gloo_timeout", 1800)))
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


if __name__ == "__main__":
    r, w, init_file, out_dir, spec_file = sys.argv[1:6]
    worker(int(r), int(w), init_file, Path(out_dir), json.loads(Path(spec_file).read_text()))
    sys.stdout.flush()
    os._exit(0)
