"""Reports piped to another program (stdout not a terminal, COLUMNS unset) are never hard-wrapped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import ucp

REPO = Path(__file__).resolve().parents[3]


def _piped(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        [sys.executable, "-m", "ucp.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )


def test_convert_report_is_one_line_when_piped(tmp_path: Path) -> None:
    deep = tmp_path / ("a-long-folder-name-" * 6) / "model"  # the report line is far beyond 80 (and 160) columns
    deep.mkdir(parents=True)
    save_file({"w": torch.ones(2, 3)}, deep / "model.safetensors")
    run = _piped("convert", str(deep / "model.safetensors"), str(deep / "out"), "--from", "hf")
    assert run.returncode == 0, run.stderr
    [line] = [ln for ln in run.stdout.splitlines() if ln.strip()]
    assert line.startswith("converted hf ") and ": 1 tensors, " in line and str(deep / "out") in line
    assert len(line) > 200


def test_inspect_table_rows_are_not_folded_when_piped(tmp_path: Path) -> None:
    name = "model.layers.0." + "very_long_parameter_name_" * 8 + "weight"
    ucp.save({name: torch.zeros(3)}, tmp_path / "ck")
    run = _piped("inspect", str(tmp_path / "ck"))
    assert run.returncode == 0, run.stderr
    assert any(name in line for line in run.stdout.splitlines()), run.stdout


def test_error_lines_are_not_wrapped_when_piped(tmp_path: Path) -> None:
    missing = tmp_path / ("no-such-folder-" * 10)
    run = _piped("inspect", str(missing))
    assert run.returncode == 2
    assert run.stderr.splitlines() == [f"error: {missing} does not exist"]
