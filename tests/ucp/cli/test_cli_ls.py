"""``ucp ls ROOT``: the table and the JSON listing of a CheckpointManager root."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from ucp.cli.main import app
from ucp.manager import CheckpointManager

runner = CliRunner()


def make_root(root):
    m = CheckpointManager(root, keep_last=3)
    for step in (100, 200):
        m.save({"w": torch.full((1024,), float(step))}, step)
    leftover = root / ".step-00000300.tmp-0123456789ab"
    leftover.mkdir()
    (leftover / "rank-00000.safetensors").write_bytes(b"\0" * 4096)
    return m


def test_ls_json_lists_steps_sizes_statuses_and_latest(tmp_path):
    make_root(tmp_path)
    result = runner.invoke(app, ["ls", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["latest"] == 200 and doc["latest_pointer"] == {"step": 200, "name": "step-00000200"}
    rows = [(c["step"], c["name"], c["status"], c["latest"]) for c in doc["checkpoints"]]
    assert rows == [
        (100, "step-00000100", "complete", False),
        (200, "step-00000200", "complete", True),
        (300, ".step-00000300.tmp-0123456789ab", "temp", False),
    ]
    sizes = [c["size"] for c in doc["checkpoints"]]
    assert sizes[0] > 4096 and sizes[1] > 4096 and sizes[2] == 4096


def test_ls_table(tmp_path):
    make_root(tmp_path)
    result = runner.invoke(app, ["ls", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    row200 = next(line for line in lines if "step-00000200" in line)
    assert "complete" in row200 and "latest" in row200
    row300 = next(line for line in lines if "step-00000300" in line)
    assert "temp" in row300 and "latest" not in row300
    assert "4 KiB" in row300


def test_ls_warns_when_latest_is_not_complete(tmp_path):
    make_root(tmp_path)
    (tmp_path / "step-00000200" / "manifest.json").unlink()
    result = runner.invoke(app, ["ls", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "incomplete" in result.stdout and "falls back" in result.stdout
    doc = json.loads(runner.invoke(app, ["ls", str(tmp_path), "--json"]).stdout)
    assert doc["latest"] == 100 and doc["latest_pointer"]["step"] == 200  # what a resume loads: the newest complete


def test_ls_empty_and_missing_roots(tmp_path):
    result = runner.invoke(app, ["ls", str(tmp_path)])
    assert result.exit_code == 0 and "no checkpoints" in result.stdout
    result = runner.invoke(app, ["ls", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "does not exist" in " ".join(result.output.split())
    result = runner.invoke(app, ["--help"])
    assert " ls " in result.stdout
