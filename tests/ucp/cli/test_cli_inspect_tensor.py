"""``ucp inspect -t NAME`` prints just that tensor: its row, not the checkpoint's other tensors or tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ucp
from ucp.cli.main import app

runner = CliRunner()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    state = {"model": {"a.weight": torch.zeros(2, 3), "a.bias": torch.zeros(3), "b[0]": torch.ones(5)}, "step": 3}
    ucp.save(state, tmp_path / "ck", metadata={"run": "x"})
    return tmp_path / "ck"


def test_one_tensor_by_name(ckpt: Path) -> None:
    result = runner.invoke(app, ["inspect", str(ckpt), "-t", "model.a.weight"])
    assert result.exit_code == 0, result.output
    assert "model.a.weight" in result.stdout and "[2, 3]" in result.stdout
    for other in ("model.a.bias", "model.b[0]", "data files", "metadata", "non-tensor state", "format version"):
        assert other not in result.stdout, other


def test_a_name_with_glob_characters_is_taken_as_the_name(ckpt: Path) -> None:
    """'model.b[0]' as a glob would match 'model.b0'; it names the tensor 'model.b[0]' itself."""
    result = runner.invoke(app, ["inspect", str(ckpt), "--tensor", "model.b[0]", "--json"])
    assert result.exit_code == 0, result.output
    assert [t["name"] for t in json.loads(result.stdout)["tensors"]] == ["model.b[0]"]


def test_a_glob_shows_the_tensors_it_matches(ckpt: Path) -> None:
    result = runner.invoke(app, ["inspect", str(ckpt), "-t", "model.a.*"])
    assert result.exit_code == 0
    assert "model.a.weight" in result.stdout and "model.a.bias" in result.stdout
    assert "model.b[0]" not in result.stdout and "data files" not in result.stdout


def test_no_match_prints_nothing_and_says_so(ckpt: Path) -> None:
    result = runner.invoke(app, ["inspect", str(ckpt), "-t", "nope"])
    assert result.exit_code == 0 and result.stdout == ""
    assert "no tensor matches 'nope'" in result.stderr
