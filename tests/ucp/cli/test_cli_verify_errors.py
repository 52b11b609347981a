"""``ucp verify`` (and ``inspect``) on damaged checkpoints: ``--json`` prints one object whatever goes wrong;
a manifest or data file that is a FIFO or a directory is refused, never waited on; state-tree errors name
the manifest and the node."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result
from ucp_helpers import cli_error_line

import ucp
from ucp.cli.main import app
from ucp.cli.verify import VerifyOutput

runner = CliRunner()


def _verify_json(*args: str) -> tuple[VerifyOutput, Result]:
    result = runner.invoke(app, ["verify", *args, "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    out = VerifyOutput.model_validate(json.loads(result.stdout))
    assert out.exit_code == result.exit_code
    return out, result


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    ucp.save({"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 3}, path, step=3)
    return path


def _edit_manifest(path: Path, edit) -> None:  # noqa: ANN001
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


# -- verify --json: one object on stdout whatever goes wrong ------------------------------------------


def test_verify_json_bad_storage_options(ckpt: Path) -> None:
    out, result = _verify_json(str(ckpt), "--storage-options", "[1]")
    assert result.exit_code == 2 and not out.ok
    [p] = out.problems
    assert p.kind == "UsageError" and p.message == "--storage-options must be a JSON object"
    assert "--storage-options" in result.stderr


@pytest.mark.parametrize("url", ["nosuchproto://bucket/ck", "memory://ucp-review-cmds/none"])
def test_verify_json_unopenable_url_names_it(url: str) -> None:
    out, result = _verify_json(url)
    assert result.exit_code == 2 and out.problems and url in out.problems[0].message
    cli_error_line(runner.invoke(app, ["verify", url]), 2, url)


def test_verify_json_unreadable_manifest_names_it(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink()
    os.symlink("manifest.json", ckpt / "manifest.json")  # a loop: ELOOP on open
    out, result = _verify_json(str(ckpt))
    assert result.exit_code == 1 and str(ckpt / "manifest.json") in out.problems[0].message  # a storage error: 1


# -- non-regular files --------------------------------------------------------------------------------


def test_verify_and_load_name_a_data_file_that_is_a_directory(ckpt: Path) -> None:
    data = ckpt / "rank-00000.safetensors"
    data.unlink()
    data.mkdir()
    out, result = _verify_json(str(ckpt))
    [p] = out.problems
    assert result.exit_code == 1 and p.file == "rank-00000.safetensors" and p.kind == "CorruptCheckpointError"
    assert "is not a regular file but a directory" in p.message and "truncated" not in p.message
    with pytest.raises(ucp.CheckpointError, match="rank-00000.safetensors.*not a regular file"):
        ucp.load(ckpt)


def _run_with_deadline(fn, seconds: float = 60.0, unblock: Path | None = None):  # noqa: ANN001, ANN202
    """fn() in a thread; fails (after opening ``unblock`` for writing, to free a blocked reader) if it hangs."""
    box: dict[str, object] = {}
    thread = threading.Thread(target=lambda: box.update(value=fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if unblock is not None:
            os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"still running after {seconds} s")
    return box["value"]


def test_manifest_that_is_a_fifo_is_refused_not_waited_on(ckpt: Path) -> None:
    manifest = ckpt / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    result = _run_with_deadline(lambda: runner.invoke(app, ["inspect", str(ckpt)]), unblock=manifest)
    cli_error_line(result, 1, str(manifest), "not a regular file (a FIFO)")  # a damaged checkpoint: 1
    out, _ = _run_with_deadline(lambda: _verify_json(str(ckpt)), unblock=manifest)
    assert out.exit_code == 1 and str(manifest) in out.problems[0].message


def test_manifest_that_is_a_directory_is_no_checkpoint(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").mkdir()
    with pytest.raises(ucp.NotACheckpointError, match="not a checkpoint"):
        ucp.read_manifest(ckpt)


# -- state-tree errors name the manifest --------------------------------------------------------------


@pytest.mark.parametrize(
    "state,words",
    [
        ({"tensor": "nope"}, "state: the root must be a dict node"),
        (
            {"dict": {"model": {"dict": {"w": {"tensor": "model.w"}}}, "step": {"pickle": 1}}},
            "state['step']: a state node must be",
        ),
        (
            {"dict": {"model": {"dict": {"w": {"tensor": "model.w"}}}, "step": {"items": 3}}},
            "state['step']: 'items' must hold a list of [key, value] pairs",
        ),
    ],
)
def test_state_tree_errors_name_the_manifest_and_node(ckpt: Path, state: dict, words: str) -> None:
    _edit_manifest(ckpt, lambda m: m.update(state=state))
    manifest = str(ckpt / "manifest.json")
    line = cli_error_line(runner.invoke(app, ["inspect", str(ckpt)]), 1, words)  # a damaged manifest: 1
    assert line.startswith(f"error: {manifest}: state")
    out, _ = _verify_json(str(ckpt))
    assert out.exit_code == 1 and out.problems[0].message.startswith(f"{manifest}: state")
