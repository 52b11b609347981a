"""Commands that move no tensor data start without importing torch (``ucp ls``, ``ucp inspect``, ``--help``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucp

REPO = Path(__file__).resolve().parents[3]


def _imported(*argv: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run ``python -X importtime -m ucp.cli ARGV``; (the run, the modules it imported)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ucp.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    modules = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
    return run, modules


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A CheckpointManager root with two checkpoints."""
    with ucp.CheckpointManager(tmp_path / "run") as manager:
        for step in (1, 2):
            manager.save({"w": torch.full((4,), float(step)), "step": step}, step)
    return tmp_path / "run"


@pytest.mark.parametrize(
    "argv",
    [("ls", "{root}"), ("ls", "{root}", "--json"), ("inspect", "{ckpt}"), ("inspect", "{ckpt}", "--json"), ("--help",)],
    ids=["ls", "ls-json", "inspect", "inspect-json", "help"],
)
def test_read_only_commands_do_not_import_torch(root: Path, argv: tuple[str, ...]) -> None:
    args = [a.format(root=root, ckpt=root / "step-00000002") for a in argv]
    run, modules = _imported(*args)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ucp.cli.main" in modules  # importtime works here
    assert "torch" not in modules, [m for m in modules if m.startswith("torch")][:5]
    if argv[0] == "ls":
        assert "step-00000002" in run.stdout
    elif argv[0] == "inspect":
        assert "w" in run.stdout


def test_the_manager_module_does_not_import_torch() -> None:
    """Listing checkpoints and resolving ``latest`` (ucp.manager's read-only part) need no torch."""
    code = "import sys, ucp.manager; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr
