"""``ucp ls``: the ``latest`` it shows is what a resume loads (whatever the pointer holds), nothing complete,
bad roots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner
from ucp_helpers import cli_error_line

from ucp.cli.main import app
from ucp.manager import CheckpointManager

runner = CliRunner()


# -- ls -----------------------------------------------------------------------------------------------


def _root_with_two_steps(root: Path) -> Path:
    m = CheckpointManager(root, keep_last=5)
    for step in (1, 2):
        m.save({"w": torch.ones(4)}, step)
    return root


@pytest.mark.parametrize(
    "pointer,words",
    [
        (None, "there is no 'latest' pointer"),
        (b"{ not json", "the 'latest' pointer cannot be read"),
        (
            json.dumps({"step": 3, "name": "step-00000003"}).encode(),
            "'latest' names step-00000003, which is not complete",
        ),
    ],
)
def test_ls_latest_is_what_a_resume_loads(tmp_path: Path, pointer: bytes | None, words: str) -> None:
    root = _root_with_two_steps(tmp_path / "root")
    (root / "latest").unlink()
    if pointer is not None:
        (root / "latest").write_bytes(pointer)
    doc = json.loads(runner.invoke(app, ["ls", str(root), "--json"]).stdout)
    assert doc["latest"] == CheckpointManager(root).latest() == 2
    assert [c["step"] for c in doc["checkpoints"] if c["latest"]] == [2]
    [note] = doc["notes"]
    assert words in note and "step-00000002" in note
    result = runner.invoke(app, ["ls", str(root)])
    assert result.exit_code == 0 and "← latest" in result.stdout and words in result.stdout


def test_ls_with_a_good_pointer_has_no_note(tmp_path: Path) -> None:
    root = _root_with_two_steps(tmp_path / "root")
    doc = json.loads(runner.invoke(app, ["ls", str(root), "--json"]).stdout)
    assert doc["latest"] == 2 and doc["notes"] == [] and doc["latest_pointer"] == {"step": 2, "name": "step-00000002"}


def test_ls_nothing_complete(tmp_path: Path) -> None:
    root = _root_with_two_steps(tmp_path / "root")
    for step in (1, 2):
        (root / f"step-0000000{step}" / "manifest.json").unlink()
    doc = json.loads(runner.invoke(app, ["ls", str(root), "--json"]).stdout)
    assert doc["latest"] is None and CheckpointManager(root).latest() is None
    assert "no checkpoint is complete" in doc["notes"][0]


def test_ls_bad_roots_exit_2(tmp_path: Path) -> None:
    nope = str(tmp_path / "nope")
    cli_error_line(runner.invoke(app, ["ls", nope]), 2, nope, "does not exist")
    (tmp_path / "f").write_text("x")
    cli_error_line(runner.invoke(app, ["ls", str(tmp_path / "f")]), 2, str(tmp_path / "f"), "is not a directory")
    url = "memory://ucp-review-cmds/root"  # URL roots are listed (tests/ucp/cli/test_cli_s3.py); an empty one is none
    cli_error_line(runner.invoke(app, ["ls", url]), 2, url, "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    doc = json.loads(runner.invoke(app, ["ls", str(empty), "--json"]).stdout)
    assert doc == {"root": str(empty), "latest": None, "latest_pointer": None, "notes": [], "checkpoints": []}
