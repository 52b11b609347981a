"""``python -m training.run``: JSON lines per step, alone and under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
ARGS = ["--steps", "3", "--model", "tiny", "--micro-batch", "2", "--seq-len", "32", "--lr", "1e-2", "--clip", "1.0"]


def lines(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


def run(cmd: list[str]) -> list[dict]:
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return lines(p.stdout)


def test_single_process_prints_one_line_per_step() -> None:
    out = run([sys.executable, "-m", "training.run", *ARGS, "--zero", "3", "--start-step", "5"])
    steps = [x for x in out if "step" in x]
    assert [x["step"] for x in steps] == [5, 6, 7]
    assert all(x["loss"] > 0 and x["grad_norm"] > 0 and x["skipped"] is False for x in steps)
    assert out[-1]["done"] is True and out[-1]["mesh"] == {"tp": 1, "pp": 1, "dp": 1}


def test_torchrun_tensor_parallel_matches_one_process() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        torchrun = Path(shutil.which("torchrun") or "torchrun")
    alone = [x["loss"] for x in run([sys.executable, "-m", "training.run", *ARGS]) if "step" in x]
    tp = run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "training.run",
            *ARGS,
            "--tp",
            "2",
            "--zero",
            "2",
        ]
    )
    assert tp[-1]["mesh"] == {"tp": 2, "pp": 1, "dp": 1}
    got = [x["loss"] for x in tp if "step" in x]
    assert got == pytest.approx(alone, rel=1e-5)
