"""Kill -9 a run training with NVMe optimizer offload, then resume: the latest complete checkpoint loads, the
losses continue as the uninterrupted run's, and the killed run's swap directory is never read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ARGS = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "32", "--lr", "1e-2", "--clip", "1.0", "--zero", "1"]
TOTAL = 10


def offload(path: Path) -> list[str]:
    return ["--offload-optimizer", "nvme", "--nvme-path", str(path), "--sub-group-size", "65536"]


def losses(out: str) -> dict[int, float]:
    return {x["step"]: x["loss"] for x in map(json.loads, out.splitlines()) if "step" in x}


def run(args: list[str]) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "training.run", *args], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout


def test_kill_9_mid_training_then_resume_continues_the_losses(tmp_path: Path) -> None:
    swap, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    swap.mkdir()
    ref = losses(run([*ARGS, "--total-steps", str(TOTAL)]))

    cmd = [sys.executable, "-m", "training.run", *ARGS, *offload(swap), "--total-steps", str(TOTAL)]
    cmd += ["--save-dir", str(ckpt), "--save-every", "2"]
    victim = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    seen = []
    assert victim.stdout is not None
    deadline = time.monotonic() + 240
    for line in victim.stdout:
        seen.append(line)
        if '"checkpoint": 4' in line:  # the step-4 save is under way; step 4 trains meanwhile
            os.kill(victim.pid, signal.SIGKILL)
            break
        assert time.monotonic() < deadline, "the run never reached its step-4 checkpoint"
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL, "".join(seen)
    stale = list(swap.iterdir())
    assert len(stale) == 1 and stale[0].name.startswith("ucp-swap-optimizer-r0-p")  # kill -9 leaves it behind
    before = {f.name: f.stat().st_mtime_ns for f in stale[0].iterdir()}

    out = run([*ARGS, *offload(swap), "--total-steps", str(TOTAL), "--save-dir", str(ckpt), "--resume"])
    resumed = next(x["resumed"] for x in map(json.loads, out.splitlines()) if "resumed" in x)
    assert resumed in (2, 4)  # the latest complete checkpoint (step 4's async save may not have committed)
    after = losses(out)
    assert sorted(after) == list(range(resumed, TOTAL))
    assert all(after[s] == ref[s] for s in after), (after, ref)  # continuous loss, bit for bit
    assert list(swap.iterdir()) == stale  # the resumed run's own directory is gone, the stale one untouched
    assert {f.name: f.stat().st_mtime_ns for f in stale[0].iterdir()} == before
