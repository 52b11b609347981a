"""``ucp inspect --tensor``: a glob that matches nothing says so; names and values are printed as written
(brackets kept)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ucp
from ucp.cli.main import app

runner = CliRunner()


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    ucp.save({"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 3}, path, step=3)
    return path


# -- inspect --tensor ---------------------------------------------------------------------------------


def test_inspect_tensor_glob_matching_nothing_says_so(ckpt: Path) -> None:
    result = runner.invoke(app, ["inspect", str(ckpt), "--tensor", "nomatch*", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["tensors"] == []
    assert "no tensor matches 'nomatch*'" in result.stderr
    result = runner.invoke(app, ["inspect", str(ckpt), "--tensor", "model.*"])
    assert result.exit_code == 0 and "no tensor matches" not in result.stderr


def test_inspect_prints_names_and_values_as_written(tmp_path: Path) -> None:
    """Brackets in names and values are text, not rich markup ('[key]' used to vanish)."""
    ucp.save({"m": {"[key]": torch.ones(2)}, "x": {"[s]": "[a]"}}, tmp_path / "ck", metadata={"[k]": "[v]"})
    result = runner.invoke(app, ["inspect", str(tmp_path / "ck")])
    assert result.exit_code == 0
    for text in ("m.[key]", "x.[s]", '"[a]"', '{"[k]": "[v]"}'):
        assert text in result.stdout, text
