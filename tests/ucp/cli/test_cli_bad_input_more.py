"""CLI commands on bad input, continued (see tests/ucp/cli/test_cli_bad_input.py): verify's JSON on
every exit path, reshape's budget / read-back / layout errors, ls agreeing with the manager, state-tree
and non-regular-file errors naming the file, and messages printed as written (brackets kept)."""

from __future__ import annotations

import json
import os
import threading
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner
from ucp_helpers import cli_error_line

import ucp
from ucp.cli.main import app
from ucp.cli.verify import VerifyOutput
from ucp.manager import CheckpointManager

runner = CliRunner()


def _verify_json(*args: str) -> tuple[VerifyOutput, object]:
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
    assert result.exit_code == 2 and str(ckpt / "manifest.json") in out.problems[0].message


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
    cli_error_line(result, 2, str(manifest), "not a regular file (a FIFO)")
    out, _ = _run_with_deadline(lambda: _verify_json(str(ckpt)), unblock=manifest)
    assert out.exit_code == 2 and str(manifest) in out.problems[0].message


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
    line = cli_error_line(runner.invoke(app, ["inspect", str(ckpt)]), 2, words)
    assert line.startswith(f"error: {manifest}: state")
    out, _ = _verify_json(str(ckpt))
    assert out.exit_code == 2 and out.problems[0].message.startswith(f"{manifest}: state")


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
    cli_error_line(runner.invoke(app, ["ls", nope]), 2, nope, "is not a directory (it does not exist)")
    (tmp_path / "f").write_text("x")
    cli_error_line(runner.invoke(app, ["ls", str(tmp_path / "f")]), 2, str(tmp_path / "f"), "is not a directory")
    for url in ("memory://ucp-review-cmds/root", "s3://bucket/run"):
        cli_error_line(runner.invoke(app, ["ls", url]), 2, url, "local directories only")
    empty = tmp_path / "empty"
    empty.mkdir()
    doc = json.loads(runner.invoke(app, ["ls", str(empty), "--json"]).stdout)
    assert doc == {"root": str(empty), "latest": None, "latest_pointer": None, "notes": [], "checkpoints": []}
