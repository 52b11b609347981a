"""kill -9 of a process saving to an object store, at random moments (tests/ucp/test_s3_manager.py).

``python s3_kill_worker.py URL TRIALS SEED`` (the AWS variables point at the server). Each trial
forks a child that saves step after step through ``CheckpointManager(URL, keep_last=1)`` (so kills
land in retention too), synchronously or asynchronously (two trials each in turn), reporting each
step whose save returned. The worker SIGKILLs it at a random moment: up to 0.5 s after it
connected in even trials, and up to 0.5 s after its first save returned in odd ones (so a previous
checkpoint exists whatever the machine's load). Then it forks a checker that looks at the root as
a restarting job would, and fails the trial when a step prefix that load accepts holds anything
but that step's exact state, when one that load refuses is not refused as "not a checkpoint", or
when a resume would take a step older than the last one a save returned (a lost checkpoint). The
next trial goes on as a restarted job would: from the step after the one a resume takes (a kill
after a commit but before the save returned leaves a complete checkpoint of a step never reported).
Prints one JSON line per trial; exit 0 when every trial held. This process itself never talks to
the store (its children do, each after its own fork), so no client runtime is forked mid-flight.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

SHAPE = (6 * 1024 * 1024 // 4 // 512, 512)  # 6 MiB of float32: a multipart upload with 5 MiB parts
OPTS = {"part_size": "5MiB", "concurrency": 4}


def expected(step: int) -> dict:
    import torch

    return {"w": torch.full(SHAPE, float(step)) + torch.arange(SHAPE[1]), "step": step}


def saver(url: str, first: int, asynchronous: bool, out: int) -> None:
    import ucp

    manager = ucp.CheckpointManager(url, keep_last=1, async_save=asynchronous, storage_options=OPTS)
    manager.list()  # connected: the kill's clock starts now
    os.write(out, b"ready\n")
    step = first
    while True:
        handle = manager.save(expected(step), step)
        if asynchronous:
            handle.result()  # type: ignore[union-attr]
        os.write(out, f"{step}\n".encode())
        step += 1


def checker(url: str, last_saved: int) -> tuple[str | None, int]:
    import torch

    import ucp
    from ucp.manager import resume_choice

    manager = ucp.CheckpointManager(url, storage_options=OPTS)
    infos = manager.list()
    for info in infos:
        path = manager.path(info.step)
        try:
            state = ucp.load(path, storage_options=OPTS)
        except ucp.NotACheckpointError:
            if info.status == "complete":
                return f"{path} is listed complete but does not load", -1
            continue
        except ucp.CheckpointError as exc:
            return f"{path}: load failed with something other than 'not a checkpoint': {exc}", -1
        want = expected(info.step)
        if state["step"] != info.step or not torch.equal(state["w"], want["w"]):
            return f"{path} loaded, but not with step {info.step}'s state", -1
    choice = resume_choice(infos)  # what CheckpointManager.load() resumes from (loaded above when complete)
    if last_saved >= 0 and (choice is None or choice.step < last_saved):
        return f"a resume takes {choice.name if choice else 'nothing'}, but step {last_saved} had been saved", -1
    return None, choice.step if choice is not None else -1


def main() -> int:
    url, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import torch  # noqa: F401 - imported once here, not by every forked child (no tensor ops before a fork)

    import ucp.loading.loader  # noqa: F401
    import ucp.manager_remote  # noqa: F401
    import ucp.saving.async_save  # noqa: F401
    import ucp.saving.sync_save  # noqa: F401
    import ucp.store.s3  # noqa: F401

    rng = random.Random(seed)
    last_saved = -1
    first = 1
    ok = True
    for trial in range(trials):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                saver(url, first, trial % 4 >= 2, w)
            finally:
                os._exit(1)
        os.close(w)
        with os.fdopen(r, "rb", buffering=0) as f:
            assert f.readline() == b"ready\n"
            early = trial % 2 == 0
            first_line = b"" if early else f.readline()  # later trials: once a save has returned
            time.sleep(rng.uniform(0.0, 0.5))  # then at a random moment, most often mid-save
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            steps = [int(x) for x in (first_line + f.read()).split()]
        if steps:  # a returned save: a later resume must never take anything older
            last_saved = steps[-1]
            first = steps[-1] + 1
        t_check = time.perf_counter()
        rr, ww = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rr)
            try:
                problem, resumed = checker(url, last_saved)
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                problem, resumed = f"checker raised {type(exc).__name__}: {exc}", -1
            os.write(ww, json.dumps([problem, resumed]).encode())
            os._exit(0)
        os.close(ww)
        with os.fdopen(rr) as f:
            text = f.read()
        os.waitpid(pid, 0)
        problem, resumed = json.loads(text) if text else ("checker died", -1)
        ok = ok and problem is None
        if resumed >= first:  # committed, killed before its save returned: the restarted job goes on after it
            last_saved, first = resumed, resumed + 1
        t_check = time.perf_counter() - t_check
        print(
            json.dumps({"trial": trial, "saved": steps, "problem": problem, "check_s": round(t_check, 2)}), flush=True
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
