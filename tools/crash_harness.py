#!/usr/bin/env python
"""Kill saving processes at random moments and check that checkpoints survive.

Each trial starts a child process that saves over and over — one new step per
save — and SIGKILLs it after a random delay in ``[0, 3 x typical save time]``
(so kills land anywhere in the first saves: planning, writing, fsync, commit,
pointer update). Then the harness checks, from the outside:

* ``manager``: ucp.CheckpointManager(keep_last=2), synchronous saves. ``latest``
  names a complete checkpoint, at the last step the child reported or the one
  after (killed after the commit, before it could tell us); ``manager.load()``
  and every checkpoint listed complete load bit-exact; leftovers are never
  listed complete, and the next child's first save removes them.
* ``plain``: ucp.save over one path. The path always loads bit-exact, holding
  the last reported step or the next.
* ``async``: the manager with ``async_save=True, mode="process"``. After the kill
  the writer process finishes on its own: every save whose ``save()`` had
  returned is committed (``latest`` >= the last step returned), then the writer
  exits and its shared-memory staging files are gone.

usage: python tools/crash_harness.py [--trials 200] [--mode manager,plain,async] [--mib 32] [--seed 0] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MODES = ("manager", "plain", "async")
KILL_SPAN = 3  # kill delays are uniform in [0, KILL_SPAN x typical save time] after the child starts saving
PLAIN_NAME = "ckpt"


# -- the state a step saves (cheap to build, different at every step, the same in every process) ----


_BASE: dict[int, Any] = {}


def expected_state(step: int, mib: int) -> dict[str, Any]:
    """Every 16 KiB of the big tensors carries the step, so a torn mix of two saves cannot pass for either."""
    import torch

    if mib not in _BASE:
        n = max(1, (mib << 20) * 3 // 4 // 4)  # float32 elements: 3/4 of the bytes
        m = max(1, (mib << 20) // 4 // 2)  # bfloat16 elements: 1/4
        _BASE[mib] = (
            torch.arange(n, dtype=torch.float32).mul_(0.001),
            torch.arange(m, dtype=torch.float32).remainder_(251.0).to(torch.bfloat16),
        )
    w, v = (t.clone() for t in _BASE[mib])
    w[::4096] = step
    v[::8192] = step
    return {
        "model": {"w": w, "v": v},
        "optim": {"state": {0: {"step": torch.tensor(step, dtype=torch.int64)}}, "lr": 0.1},
        "step": step,
    }


def same_state(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_state(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# -- the child ------------------------------------------------------------------------------------


def child(mode: str, root: str, mib: int, conn: Any) -> None:
    """Get ready (import, start the writer process), wait for ("go", first_step), then save
    first_step, first_step+1, ... until killed, reporting each step on ``conn``."""
    import ucp
    from ucp.manager import CheckpointManager

    manager = None
    writer = None
    if mode != "plain":
        manager = CheckpointManager(root, keep_last=2, async_save=mode == "async", mode="process")
        writer = manager.saver.start() if manager.saver is not None else None  # the writer process, up front
    # Warm up like a long-running trainer (plan cached, aio engine up, staging mapped), so the kill
    # delays, drawn from the parent's warm save times, spread over whole saves and not just a cold first one.
    state = expected_state(0, mib)
    scratch = os.path.join(os.path.dirname(root), f"warmup-{os.getpid()}")
    if manager is not None and manager.saver is not None:
        manager.saver.save(state, scratch).result()
    else:
        ucp.save(state, scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    conn.send(("ready", os.getpid(), writer))
    _, step = conn.recv()
    while True:
        if manager is None:
            ucp.save(expected_state(step, mib), os.path.join(root, PLAIN_NAME), step=step)
        else:
            result = manager.save(expected_state(step, mib), step)
            if mode == "async":
                conn.send(("returned", step, writer))
                result.result()  # type: ignore[union-attr]
        conn.send(("committed", step))
        step += 1


# -- the checks -----------------------------------------------------------------------------------


@dataclass
class ModeStats:
    trials: int = 0
    killed_before_first_commit: int = 0
    leftovers_seen: int = 0
    landed_on_next_step: int = 0  # the kill came after a commit the child could not report
    killed_after_return: int = 0  # async: killed while a save that had returned was still being written
    failures: list[str] = field(default_factory=list)


class TrialError(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise TrialError(what)


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until process ``pid`` has exited (a zombie waiting for its reaper counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


class Harness:
    def __init__(self, root: str, mib: int, seed: int) -> None:
        self.root = root
        self.mib = mib
        self.rng = random.Random(seed)
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "ucp", "ucp.manager"])
        self.stats: dict[str, ModeStats] = {m: ModeStats() for m in MODES}
        self.typical: dict[str, float] = {}
        self.step: dict[str, int] = {}
        self.verified: set[tuple[str, int, int]] = set()  # complete checkpoints already loaded and compared
        self.spares: dict[str, tuple[Any, Any]] = {}

    def dir(self, mode: str) -> str:
        return os.path.join(self.root, mode)

    def calibrate(self, mode: str) -> None:
        """First checkpoint of the mode, saved here; its time is the 'typical save time'."""
        import ucp
        from ucp.manager import CheckpointManager

        d = self.dir(mode)
        os.makedirs(d, exist_ok=True)
        times = []
        # (async: timed with synchronous saves too — about as long, and no writer process to start here)
        with CheckpointManager(d, keep_last=2) as manager:
            for step in (0, 1, 2):
                state = expected_state(step, self.mib)
                t = time.perf_counter()
                if mode == "plain":
                    ucp.save(state, os.path.join(d, PLAIN_NAME), step=step)
                else:
                    manager.save(state, step)
                times.append(time.perf_counter() - t)
        self.typical[mode] = sorted(times)[1]
        self.step[mode] = 2

    def _spawn(self, mode: str) -> tuple[Any, Any]:
        """A child getting ready in the background (the writer process takes seconds to import torch)."""
        here, there = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(target=child, args=(mode, self.dir(mode), self.mib, there), daemon=True)
        proc.start()
        there.close()
        return proc, here

    def trial(self, mode: str, *, more: bool = True) -> None:
        """One kill; ``more``: another trial of this mode follows (start its child now)."""
        stats = self.stats[mode]
        stats.trials += 1
        before = self.step[mode]
        leftovers_before = self._leftovers(mode)
        proc, conn = self.spares.pop(mode) if mode in self.spares else self._spawn(mode)
        msgs = [conn.recv()]  # ("ready", pid, writer pid)
        if more:
            self.spares[mode] = self._spawn(mode)  # the next trial's child warms up meanwhile
        conn.send(("go", before + 1))
        delay = self.rng.uniform(0, KILL_SPAN * self.typical[mode])
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        while conn.poll():
            try:
                msgs.append(conn.recv())
            except (EOFError, OSError):
                break
        conn.close()
        committed = [m[1] for m in msgs if m[0] == "committed"]
        returned = [m[1] for m in msgs if m[0] == "returned"]
        writers = {m[2] for m in msgs if m[0] in ("ready", "returned") and m[2]}
        if not committed:
            stats.killed_before_first_commit += 1
        for pid in writers:  # process mode: the writer finishes on its own, then leaves
            check(wait_gone(pid, 60), f"writer process {pid} still running 60 s after its trainer died")
            staging = [f for f in os.listdir("/dev/shm") if f.startswith(f"ucp-staging-{proc.pid}-")]
            check(not staging, f"staging files left in /dev/shm: {staging}")
        if set(returned) - set(committed):
            stats.killed_after_return += 1
        last = max(committed + returned + [before])
        got = self._check(mode, last, delay)
        if got == last + 1:
            stats.landed_on_next_step += 1
        if mode != "plain" and committed:
            gone = leftovers_before - self._leftovers(mode)
            check(gone == leftovers_before, f"leftovers {sorted(leftovers_before - gone)} survived a later save")
        stats.leftovers_seen += len(self._leftovers(mode))
        self.step[mode] = max(got, last)

    def _leftovers(self, mode: str) -> set[str]:
        return {n for n in os.listdir(self.dir(mode)) if n.startswith(".") and (".tmp-" in n or ".old-" in n)}

    def _check(self, mode: str, last: int, delay: float) -> int:
        """The post-kill checks; returns the step now considered latest."""
        import ucp
        from ucp.manager import CheckpointManager, check_complete, read_latest

        where = f"{mode}, kill after {delay * 1000:.1f} ms, last reported step {last}"
        if mode == "plain":
            state = ucp.load(os.path.join(self.dir(mode), PLAIN_NAME))
            step = state["step"]
            check(step in (last, last + 1), f"{where}: the checkpoint holds step {step}")
            check(same_state(expected_state(step, self.mib), state), f"{where}: step {step} is not bit-exact")
            return step
        d = self.dir(mode)
        pointer = read_latest(d)
        check(pointer is not None, f"{where}: no readable 'latest'")
        step, name = pointer  # type: ignore[misc]
        status = check_complete(os.path.join(d, name))
        check(status[0] == "complete", f"{where}: 'latest' names {name}, which is {status[0]}: {status[2]}")
        if mode == "async":  # every save that returned was committed by the orphaned writer
            check(step in (last, last + 1), f"{where}: latest is step {step}, a returned save was lost")
        else:
            check(step in (last, last + 1), f"{where}: latest is step {step}")
        manager = CheckpointManager(d)
        state = manager.load()
        # load() takes the newest complete checkpoint: the pointer's, or the one committed by a save that
        # was killed before it moved the pointer
        loaded = manager.loaded_step
        check(
            loaded is not None and loaded in (step, last + 1), f"{where}: load() read step {loaded}, latest is {step}"
        )
        assert loaded is not None
        check(same_state(expected_state(loaded, self.mib), state), f"{where}: loaded step {loaded} is not bit-exact")
        for info in manager.list():
            if info.status == "complete":
                st = os.stat(os.path.join(info.path, "manifest.json"))
                key = (info.path, st.st_ino, st.st_mtime_ns)
                if key in self.verified or info.step == step:
                    continue
                self.verified.add(key)
                other = ucp.load(info.path)
                check(
                    same_state(expected_state(info.step, self.mib), other),
                    f"{where}: {info.name} is listed complete but does not load bit-exact",
                )
            else:
                check(info.status in ("temp", "old"), f"{where}: unexpected {info.status} entry {info.name}")
        return step

    def finish(self, mode: str) -> None:
        """A last save must leave no leftovers (manager modes)."""
        if mode == "plain":
            return
        from ucp.manager import CheckpointManager

        CheckpointManager(self.dir(mode), keep_last=2).save(
            expected_state(self.step[mode] + 1, self.mib), self.step[mode] + 1
        )
        check(not self._leftovers(mode), f"{mode}: leftovers after a clean save: {self._leftovers(mode)}")

    def run(self, modes: list[str], trials: int) -> dict[str, Any]:
        for mode in modes:
            self.calibrate(mode)
        for i in range(trials):
            mode = modes[i % len(modes)]
            try:
                self.trial(mode, more=i + len(modes) < trials)
            except TrialError as exc:
                self.stats[mode].failures.append(f"trial {i}: {exc}")
        for proc, conn in self.spares.values():  # unused warm children: their writers leave with them
            proc.kill()
            proc.join()
            conn.close()
        for mode in modes:
            try:
                self.finish(mode)
            except TrialError as exc:
                self.stats[mode].failures.append(f"final save: {exc}")
        return {
            "mib": self.mib,
            "typical_save_ms": {m: round(t * 1000, 1) for m, t in self.typical.items()},
            "modes": {m: asdict(self.stats[m]) for m in modes},
            "ok": not any(self.stats[m].failures for m in modes),
        }


def run_trials(
    trials: int, modes: list[str], *, mib: int = 32, seed: int = 0, root: str | None = None
) -> dict[str, Any]:
    """Run ``trials`` kills, cycling through ``modes``; a report dict (``ok``, per-mode stats and failures)."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r} (choose from {MODES})")
    base = tempfile.mkdtemp(prefix="ucp-crash-", dir=root)
    try:
        return Harness(base, mib, seed).run(modes, trials)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=30, help="kills in all (cycling through the modes)")
    ap.add_argument("--mode", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--mib", type=int, default=32, help="state dict size per save (MiB)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill delays")
    ap.add_argument("--root", default=None, help="where to make the scratch directory (default: system temp)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    report = run_trials(
        args.trials,
        [m.strip() for m in args.mode.split(",") if m.strip()],
        mib=args.mib,
        seed=args.seed,
        root=args.root,
    )
    report["seconds"] = round(time.perf_counter() - t, 1)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for mode, s in report["modes"].items():
            print(
                f"{mode:8s} trials={s['trials']:4d} killed-before-first-commit={s['killed_before_first_commit']:3d} "
                f"landed-on-next-step={s['landed_on_next_step']:3d} killed-after-return={s['killed_after_return']:3d} leftovers-seen={s['leftovers_seen']:3d} "
                f"failures={len(s['failures'])}"
            )
            for f in s["failures"][:10]:
                print("   ", f)
        print(
            f"typical save (ms): {report['typical_save_ms']}  total {report['seconds']} s  "
            f"{'OK' if report['ok'] else 'FAILED'}"
        )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
