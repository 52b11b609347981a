"""``ucp reshape`` on bad input: a memory budget below the minimum, read-back verification problems in
``--json``, recorded layouts that cannot be used, each a one-line error."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner
from ucp_helpers import cli_error_line

import ucp
from ucp.cli.main import app

runner = CliRunner()


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    ucp.save({"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 3}, path, step=3)
    return path


# -- reshape ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["0", "1", "512KiB", "0.5MiB"])
def test_reshape_budget_below_the_minimum_is_a_bad_option(ckpt: Path, tmp_path: Path, budget: str) -> None:
    result = runner.invoke(app, ["reshape", str(ckpt), str(tmp_path / "o"), "--memory-budget", budget])
    cli_error_line(result, 2, f"--memory-budget {budget}", "at least 1 MiB")
    assert not (tmp_path / "o").exists()


def test_reshape_verify_json_carries_the_problems(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = types.SimpleNamespace(
        kind="CorruptCheckpointError",
        message="tensor 'model.w': CRC-32C mismatch [x]",
        file="rank-00000.safetensors",
        tensor="model.w",
        offset=4096,
    )
    monkeypatch.setattr(ucp, "verify", lambda path, **kw: types.SimpleNamespace(ok=False, problems=[bad]))
    result = runner.invoke(app, ["reshape", str(ckpt), str(tmp_path / "o"), "--verify", "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["verified"] is False
    assert doc["problems"] == [
        {
            "kind": "CorruptCheckpointError",
            "message": bad.message,
            "file": "rank-00000.safetensors",
            "tensor": "model.w",
            "offset": 4096,
        }
    ]
    text = runner.invoke(app, ["reshape", str(ckpt), str(tmp_path / "t"), "--verify"])
    assert text.exit_code == 1 and bad.message in text.stdout  # printed as written: "[x]" is no markup


def test_reshape_verify_that_cannot_read_back_is_a_problem(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path, **kw):  # noqa: ANN001, ANN003, ANN202
        raise PermissionError(13, "Permission denied", str(Path(path) / "manifest.json"))

    monkeypatch.setattr(ucp, "verify", refuse)
    result = runner.invoke(app, ["reshape", str(ckpt), str(tmp_path / "o"), "--verify", "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["verified"] is False
    [p] = doc["problems"]
    assert p["kind"] == "PermissionError" and str(tmp_path / "o" / "manifest.json") in p["message"]


def test_reshape_verify_clean_has_no_problems(ckpt: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["reshape", str(ckpt), str(tmp_path / "o"), "--verify", "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["verified"] is True and doc["problems"] == []


@pytest.mark.parametrize(
    "metadata,words",
    [
        ({"layout": {"mesh": {"tp": "x"}}}, "metadata.layout is not a valid layout: "),
        ({"shapes": 5}, "metadata.shapes must be a list of [name, shape] pairs"),
    ],
)
def test_reshape_bad_recorded_layout_is_one_line(tmp_path: Path, metadata: dict, words: str) -> None:
    src = tmp_path / "src"
    ucp.save({"model": {"w": torch.ones(4, 4)}}, src, metadata=metadata)
    line = cli_error_line(
        runner.invoke(app, ["reshape", str(src), str(tmp_path / "o"), "--tp", "2"]),
        2,
        str(src / "manifest.json"),
        words,
    )
    assert "pydantic" not in line
    assert not (tmp_path / "o").exists()
