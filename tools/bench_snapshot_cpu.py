#!/usr/bin/env python
"""CPU cost per GiB of an asynchronous save's snapshot, this tree against an older commit, in one run.

    .venv/bin/python tools/bench_snapshot_cpu.py                      # 1 GiB, before = 0b5b537
    .venv/bin/python tools/bench_snapshot_cpu.py --gib 2 --rounds 3 --before 0b5b537 --modes sync background

For each snapshot mode (``sync``, ``background``, ``cow`` in thread mode, ``sync`` in process mode) and
each tree (``before``: a git worktree of ``--before``, made in a temporary directory and removed at the
end; ``after``: this tree), a fresh child process saves a state dict of ``--gib`` GiB of fp32 tensors
with ``AsyncSaver`` ``--saves`` times after one warm-up save (staging arenas, helper processes, the
kernels' build are ready by then), into a directory on ``--dir``'s file system. Trees and modes run
interleaved, ``--rounds`` times; the table shows medians.

Measured per GiB of state, as CPU seconds (user + system) of the training process's threads plus its
helper processes (the writer process, the copy-on-write helper; read from ``/proc``):

* ``snapshot``: from ``save()`` until the state is copied (``handle.wait_copied()``): the copy, and
  with the fused copy its CRC-32C (the writer following a deferred copy counts here too);
* ``save``: from ``save()`` until the checkpoint is committed: copy, checksums and the write;
* ``stall``: the calling thread's own CPU inside ``save()`` (what training pays before it goes on).

The snapshot's CPU cost per GiB is ``save`` minus what writing costs, which is the same in both
trees; ``save`` is the figure that holds the whole of the copy and checksum work wherever it runs.
Progress goes to stderr, the markdown to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODES = ("sync", "background", "cow", "process-sync")
TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (0 when unknown or gone)."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15 of stat)


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(mode: str, gib: float, saves: int, directory: str) -> dict[str, Any]:
    """Run in the tree under test (PYTHONPATH): the per-GiB medians of ``saves`` timed saves."""
    import torch

    from ucp.saving.async_save import AsyncSaver

    torch.manual_seed(0)
    total = int(gib * (1 << 30))
    sizes = [total // 16] * 16  # 16 tensors, 64 MiB each at 1 GiB
    state = {f"layer{i}.weight": torch.randn(n // 4) for i, n in enumerate(sizes)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    kind, _, snap = mode.rpartition("-")
    saver = AsyncSaver(mode=kind or "thread", snapshot=snap)  # type: ignore[arg-type]

    def helper_cpu() -> float:
        cow = getattr(saver, "_cow", None)
        pids = {saver.writer_pid, getattr(getattr(cow, "_proc", None), "pid", None)}
        return sum(_proc_cpu(p) for p in pids)

    rows: dict[str, list[float]] = {"snapshot": [], "save": [], "stall": [], "wall": []}
    try:
        for k in range(saves + 1):
            path = os.path.join(directory, f"ckpt-{k}")
            c0, h0, w0, s0 = _self_cpu(), helper_cpu(), time.perf_counter(), time.thread_time()
            handle = saver.save(state, path)
            stall = time.thread_time() - s0
            handle.wait_copied()
            c1, h1 = _self_cpu(), helper_cpu()
            handle.result()
            c2, h2, w2 = _self_cpu(), helper_cpu(), time.perf_counter()
            shutil.rmtree(path)
            if k == 0:
                continue  # warm-up: arenas, helpers, the kernels' build
            gibs = nbytes / (1 << 30)
            rows["snapshot"].append((c1 - c0 + h1 - h0) / gibs)
            rows["save"].append((c2 - c0 + h2 - h0) / gibs)
            rows["stall"].append(stall / gibs)
            rows["wall"].append((w2 - w0) / gibs)
    finally:
        saver.close()
    import kernels

    return {"mode": saver.snapshot, **{k: statistics.median(v) for k, v in rows.items()}, "kernels": kernels.backend()}


def _run_child(tree: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ucp-bench-snap-") as d:
        cmd = [sys.executable, __file__, "--child", mode, "--gib", str(args.gib), "--saves", str(args.saves)]
        out = subprocess.run(cmd + ["--dir", d], env=env, cwd=tree, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"{tree} {mode}: child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="0b5b537", help="the commit to compare with (a git worktree of it)")
    ap.add_argument("--gib", type=float, default=1.0, help="state dict size in GiB")
    ap.add_argument("--saves", type=int, default=3, help="timed saves per child process (after one warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (a fresh child each)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="file system the checkpoints go to")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.gib, args.saves, args.dir)))
        return

    base = Path(tempfile.mkdtemp(prefix="ucp-bench-before-"))
    _git("worktree", "add", "--detach", str(base / "tree"), args.before)
    trees = {"before": base / "tree", "after": REPO}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for r in range(args.rounds):
            for mode in args.modes:
                for label, tree in trees.items():
                    res = _run_child(tree, mode, args)
                    results.setdefault((mode, label), []).append(res)
                    print(f"round {r + 1} {mode:13s} {label:6s} {json.dumps(res)}", file=sys.stderr)
    finally:
        _git("worktree", "remove", "--force", str(base / "tree"))
        shutil.rmtree(base, ignore_errors=True)

    def med(mode: str, label: str, key: str) -> float:
        return statistics.median(x[key] for x in results[(mode, label)])

    after = _git("rev-parse", "--short", "HEAD") + ("+dirty" if _git("status", "--porcelain", "--", "ucp") else "")
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, before = {args.before}, after = {after}, "
        f"{args.gib:g} GiB fp32 state (16 tensors), {args.saves} saves x {args.rounds} rounds, medians, "
        f"{os.cpu_count()} CPUs; kernels: {results[(args.modes[0], 'after')][0]['kernels']}\n"
    )
    print(
        "| mode | snapshot CPU s/GiB before → after | save CPU s/GiB before → after | change | "
        "stall CPU s/GiB before → after | wall s/GiB before → after |"
    )
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        cells = []
        for key in ("snapshot", "save"):
            cells.append(f"{med(mode, 'before', key):.3f} → {med(mode, 'after', key):.3f}")
        change = med(mode, "after", "save") / med(mode, "before", "save") - 1
        cells.append(f"{change:+.0%}")
        for key in ("stall", "wall"):
            cells.append(f"{med(mode, 'before', key):.3f} → {med(mode, 'after', key):.3f}")
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
