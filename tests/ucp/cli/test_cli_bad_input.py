"""The ``ucp`` CLI against bad and edge-case input: every failure must be a one-line ``error:``
naming what is at fault, with the documented exit code, no traceback, no partial output, and
``--json`` stdout that parses."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner
from ucp_helpers import cli_error_line

import ucp
from ucp.cli.main import app
from ucp.cli.verify import VerifyOutput
from ucp.format.manifest import seal
from ucp.manager import CheckpointManager

runner = CliRunner()
W = torch.arange(12.0).reshape(3, 4)


def _strict_json(text: str):
    """json.loads that refuses NaN/Infinity (not JSON)."""

    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _no_traceback(result) -> None:  # noqa: ANN001 - click's Result
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output + result.stderr


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    ucp.save({"model": {"w": W.clone()}, "step": 3}, path, step=3)
    return path


def _edit_manifest(path: Path, edit) -> Path:  # noqa: ANN001
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))
    return path


# -- inspect / verify: damaged manifests --------------------------------------------------------------

BAD_MANIFESTS = {
    "empty": (b"", "not valid JSON"),
    "binary": (b"\xff\xfe\x00garbage", "not valid JSON"),
    "list": (b"[]", "must hold a JSON object"),
    "deep": (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    "huge-int": (b'{"format_version": 1' + b"0" * 5000 + b"}", "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_unparseable_manifest_is_one_line_exit_1(ckpt: Path, case: str) -> None:
    """A damaged manifest is damaged data (exit 1), not bad input."""
    data, words = BAD_MANIFESTS[case]
    (ckpt / "manifest.json").write_bytes(data)
    manifest = str(ckpt / "manifest.json")
    cli_error_line(runner.invoke(app, ["inspect", str(ckpt)]), 1, manifest, words)
    cli_error_line(runner.invoke(app, ["verify", str(ckpt)]), 1, manifest, words)
    js = runner.invoke(app, ["verify", str(ckpt), "--json"])
    assert js.exit_code == 1
    out = VerifyOutput.model_validate(_strict_json(js.stdout))
    assert out.exit_code == 1 and manifest in out.problems[0].message


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda m: m["files"]["rank-00000.safetensors"].update(size=-1), "size -1 is out of range"),
        (lambda m: m["files"].update({"../x": m["files"].pop("rank-00000.safetensors")}), "'../x'"),
        (lambda m: m["topology"].update(world_size=0), "world_size 0"),
        (lambda m: m["tensors"]["model.w"].update(dtype="F99"), "'F99'"),
        (lambda m: m["tensors"]["model.w"].update(shape=[10**18, 10**18]), "'model.w'"),
        (lambda m: m["files"]["rank-00000.safetensors"].update(size=4143), "past the file's size"),
        (lambda m: m.update(format_version=10**30), "not supported"),
    ],
    ids=["neg-size", "traversal", "world0", "dtype", "huge-shape", "size-short", "version"],
)
def test_invalid_manifest_values_name_manifest_and_key(ckpt: Path, edit, words: str) -> None:  # noqa: ANN001
    _edit_manifest(ckpt, edit)
    manifest = str(ckpt / "manifest.json")
    code = 2 if "not supported" in words else 1  # a format version this reader does not know is bad input
    cli_error_line(runner.invoke(app, ["inspect", str(ckpt), "--json"]), code, manifest, words)
    cli_error_line(runner.invoke(app, ["verify", str(ckpt)]), code, manifest, words)


def test_bad_state_tree_error_names_the_manifest(ckpt: Path) -> None:
    _edit_manifest(ckpt, lambda m: m.update(state={"tensor": "nope"}))
    cli_error_line(runner.invoke(app, ["inspect", str(ckpt)]), 1, str(ckpt / "manifest.json"), "state")


@pytest.mark.parametrize("target", ["missing", "empty-dir", "plain-file"])
def test_not_a_checkpoint(tmp_path: Path, target: str) -> None:
    path = tmp_path / target
    if target == "empty-dir":
        path.mkdir()
    elif target == "plain-file":
        path.write_text("hello")
    words = "does not exist" if target == "missing" else "not a checkpoint"
    for cmd in ("inspect", "verify"):
        cli_error_line(runner.invoke(app, [cmd, str(path)]), 2, str(path), words)


def test_storage_options_must_be_a_json_object(ckpt: Path) -> None:
    cli_error_line(runner.invoke(app, ["inspect", str(ckpt), "--storage-options", "[1]"]), 2, "--storage-options")
    cli_error_line(runner.invoke(app, ["verify", str(ckpt), "--storage-options", "nope"]), 2, "not valid JSON")


@pytest.mark.parametrize("case", ["symlink-loop", "unknown-protocol"])
def test_verify_json_always_prints_json(ckpt: Path, case: str) -> None:
    if case == "symlink-loop":
        (ckpt / "manifest.json").unlink()
        os.symlink("manifest.json", ckpt / "manifest.json")
        target = str(ckpt)
    else:
        target = "nosuchproto://bucket/ck"
    result = runner.invoke(app, ["verify", target, "--json"])
    _no_traceback(result)
    code = 1 if case == "symlink-loop" else 2  # a storage failure (ELOOP) vs a bad URL
    assert result.exit_code == code
    out = VerifyOutput.model_validate(_strict_json(result.stdout))
    assert out.exit_code == code and not out.ok and out.problems


# -- verify: damaged data -----------------------------------------------------------------------------


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "damage,words",
    [
        (lambda f: _patch(f, 0, (1 << 62).to_bytes(8, "little")), "header"),
        (lambda f: _patch(f, 10, b"\x00\x01"), "header is not valid JSON"),
        (lambda f: open(f, "ab").write(b"x" * 10), "longer than expected"),
        (lambda f: os.truncate(f, 20), "truncated"),
    ],
    ids=["header-length", "header-bytes", "grown", "truncated"],
)
def test_verify_damaged_data_file_exit_1_names_file(ckpt: Path, damage, words: str) -> None:  # noqa: ANN001
    damage(ckpt / "rank-00000.safetensors")
    result = runner.invoke(app, ["verify", str(ckpt)])
    _no_traceback(result)
    assert result.exit_code == 1 and "'rank-00000.safetensors'" in result.stdout and words in result.stdout
    js = runner.invoke(app, ["verify", str(ckpt), "--json"])
    out = VerifyOutput.model_validate(_strict_json(js.stdout))
    assert js.exit_code == 1 and [p.file for p in out.problems] == ["rank-00000.safetensors"]


def test_verify_manifest_offset_edit_names_tensor_and_offset(ckpt: Path) -> None:
    _edit_manifest(ckpt, lambda m: m["tensors"]["model.w"]["pieces"][0].update(offset=4000))
    (ckpt / "manifest.json").write_bytes(seal((ckpt / "manifest.json").read_bytes()))  # as a forger would
    out = VerifyOutput.model_validate(_strict_json(runner.invoke(app, ["verify", str(ckpt), "--json"]).stdout))
    [p] = out.problems
    assert out.exit_code == 1 and (p.tensor, p.file, p.offset) == ("model.w", "rank-00000.safetensors", 4000)


def test_verify_data_file_that_is_a_directory(ckpt: Path) -> None:
    (ckpt / "rank-00000.safetensors").unlink()
    (ckpt / "rank-00000.safetensors").mkdir()
    result = runner.invoke(app, ["verify", str(ckpt)])
    assert result.exit_code == 1 and "rank-00000.safetensors" in result.stdout
    assert "truncated" not in result.stdout and "director" in result.stdout


# -- ls -----------------------------------------------------------------------------------------------


def test_ls_bad_roots_and_corrupt_entries(tmp_path: Path) -> None:
    cli_error_line(runner.invoke(app, ["ls", str(tmp_path / "nope")]), 2, str(tmp_path / "nope"))
    (tmp_path / "f").write_text("x")
    cli_error_line(runner.invoke(app, ["ls", str(tmp_path / "f")]), 2, "is not a directory")
    root = tmp_path / "root"
    m = CheckpointManager(root, keep_last=5)
    for step in (1, 2):
        m.save({"w": torch.ones(4)}, step)
    (root / "step-00000001" / "manifest.json").write_text("{ bad")
    doc = _strict_json(runner.invoke(app, ["ls", str(root), "--json"]).stdout)
    rows = {c["step"]: c for c in doc["checkpoints"]}
    assert rows[1]["status"] == "corrupt" and "manifest.json" in rows[1]["detail"]
    assert rows[2]["status"] == "complete" and doc["latest"] == 2


def test_ls_latest_agrees_with_the_manager_without_a_pointer(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2):
        m.save({"w": torch.ones(4)}, step)
    (tmp_path / "latest").unlink()
    doc = _strict_json(runner.invoke(app, ["ls", str(tmp_path), "--json"]).stdout)
    assert doc["latest"] == CheckpointManager(tmp_path).latest() == 2


def test_ls_url_is_named_as_given() -> None:
    result = runner.invoke(app, ["ls", "memory://ucp-review-ls/root"])
    cli_error_line(result, result.exit_code if result.exit_code in (1, 2) else 1, "memory://ucp-review-ls/root")


# -- convert ------------------------------------------------------------------------------------------


def _safetensors_variants(folder: Path) -> dict[str, Path]:
    good = folder / "good.safetensors"
    save_file({"w": torch.ones(2, 3)}, good)
    data = good.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    out = {
        "header-garbage": data[:8] + b"{" + b"x" * (n - 1) + data[8 + n :],
        "header-length": struct.pack("<Q", 1 << 40) + data[8:],
        "truncated": data[:-5],
        "tiny": b"abc",
    }
    paths = {}
    for name, blob in out.items():
        paths[name] = folder / f"{name}.safetensors"
        paths[name].write_bytes(blob)
    return paths


def test_convert_corrupt_safetensors_names_file_and_leaves_no_dst(tmp_path: Path) -> None:
    for name, path in _safetensors_variants(tmp_path).items():
        dst = tmp_path / f"out-{name}"
        result = runner.invoke(app, ["convert", str(path), str(dst), "--json"])
        cli_error_line(result, 1, path.name, "not a readable safetensors file")  # damaged data: 1
        assert result.stdout == "" and not dst.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp leftovers


def test_convert_foreign_folder_errors_name_the_file(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "latest").write_text("global_step9")
    cli_error_line(runner.invoke(app, ["convert", str(ds), str(tmp_path / "o1")]), 1, "global_step9", "missing")
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"garbage")
    cli_error_line(runner.invoke(app, ["convert", str(dcp), str(tmp_path / "o2")]), 1, ".metadata")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001.safetensors"}}))
    cli_error_line(runner.invoke(app, ["convert", str(hf), str(tmp_path / "o3")]), 1, "model-00001.safetensors")
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


def _garbage_deepspeed(folder: Path) -> Path:
    tag = folder / "global_step1"
    tag.mkdir(parents=True)
    (folder / "latest").write_text("global_step1")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tag / name).write_bytes(b"not a zip or a pickle" * 10)
    return folder


def test_convert_trust_pickle_on_garbage_pt_is_a_clean_error(tmp_path: Path) -> None:
    src = _garbage_deepspeed(tmp_path / "ds")
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--trust-pickle"])
    _no_traceback(result)
    assert result.exit_code == 1 and "mp_rank_00_model_states.pt" in result.stderr
    assert not (tmp_path / "out").exists()


def test_convert_garbage_pt_is_not_called_an_unsafe_pickle(tmp_path: Path) -> None:
    src = _garbage_deepspeed(tmp_path / "ds")
    line = cli_error_line(
        runner.invoke(app, ["convert", str(src), str(tmp_path / "out")]), 1, "mp_rank_00_model_states.pt"
    )
    assert "--trust-pickle" not in line and "not a readable" in line


def test_convert_destination_checks(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, src)
    (tmp_path / "plain").write_text("keep")
    cli_error_line(runner.invoke(app, ["convert", str(src), str(tmp_path / "plain")]), 2, "already exists")
    cli_error_line(
        runner.invoke(app, ["convert", str(src), str(tmp_path / "plain"), "--force"]), 2, "not a UCP checkpoint"
    )
    assert (tmp_path / "plain").read_text() == "keep"


def test_convert_url_destination_is_not_written_as_a_local_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, src)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    url = "memory://ucp-review-convert/x"
    result = runner.invoke(app, ["convert", str(src), url])
    _no_traceback(result)
    assert os.listdir(work) == []  # nothing written under the current directory
    assert result.exit_code == 2 or ucp.read_manifest(url).tensors  # refused, or really written to the URL


def test_convert_from_hf_refuses_a_ucp_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["convert", str(ckpt), str(tmp_path / "out"), "--from", "hf"])
    cli_error_line(result, 2, str(ckpt))


# -- export -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,words",
    [
        (["--memory-budget", "0"], "--memory-budget"),
        (["--memory-budget", "-1"], "--memory-budget"),
        (["--max-shard-size", "0"], "--max-shard-size"),
        (["--format", "zarr", "--level", "99"], "level 99"),
        (["--level", "3"], "--level apply to --format zarr only"),
    ],
)
def test_export_bad_options_exit_2(ckpt: Path, tmp_path: Path, args: list[str], words: str) -> None:
    cli_error_line(runner.invoke(app, ["export", str(ckpt), str(tmp_path / "o"), *args]), 2, words)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-5"])
def test_export_chunk_mb_must_be_a_positive_number(ckpt: Path, tmp_path: Path, value: str) -> None:
    result = runner.invoke(app, ["export", str(ckpt), str(tmp_path / "o"), "--format", "zarr", "--chunk-mb", value])
    cli_error_line(result, 2, "--chunk-mb")
    assert not (tmp_path / "o").exists()


def test_export_destination_checks(ckpt: Path, tmp_path: Path) -> None:
    cli_error_line(runner.invoke(app, ["export", str(ckpt), "memory://ucp-review-export/o"]), 2, "local paths only")
    (tmp_path / "plain").write_text("keep")
    cli_error_line(
        runner.invoke(app, ["export", str(ckpt), str(tmp_path / "plain"), "--overwrite"]), 2, "not a directory"
    )
    cli_error_line(runner.invoke(app, ["export", str(tmp_path / "nothing"), str(tmp_path / "o")]), 2, "nothing")
    assert sorted(os.listdir(tmp_path)) == ["ck", "plain"]


def test_export_damaged_source_exit_1_leaves_nothing(ckpt: Path, tmp_path: Path) -> None:
    os.truncate(ckpt / "rank-00000.safetensors", 0)
    for fmt in ("hf", "zarr"):
        result = runner.invoke(app, ["export", str(ckpt), str(tmp_path / "o"), "--format", fmt])
        cli_error_line(result, 1, "rank-00000.safetensors", "truncated")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_export_refuses_to_replace_its_own_source(ckpt: Path) -> None:
    result = runner.invoke(app, ["export", str(ckpt), str(ckpt), "--overwrite"])
    assert result.exit_code == 2
    assert ucp.verify(ckpt).ok


def test_export_into_a_symlinked_directory_leaves_no_leftover(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "target").mkdir(parents=True)
    os.symlink("target", out / "link")
    result = runner.invoke(app, ["export", str(ckpt), str(out / "link")])
    _no_traceback(result)
    assert sorted(os.listdir(out)) == ["link", "target"]


def test_convert_force_onto_a_symlink_leaves_no_leftover(ckpt: Path, tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, src)
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(ckpt, out / "real")
    os.symlink("real", out / "link")
    result = runner.invoke(app, ["convert", str(src), str(out / "link"), "--force"])
    assert result.exit_code == 0, result.stderr
    assert sorted(os.listdir(out)) == ["link", "real"]


# -- reshape ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage,words",
    [
        (lambda d: os.truncate(d / "rank-00000.safetensors", 0), "truncated"),
        (lambda d: (d / "rank-00000.safetensors").unlink(), "missing"),
        (lambda d: _patch(d / "rank-00000.safetensors", 4100, b"\xff"), "CRC-32C"),
    ],
    ids=["truncated", "missing", "flipped"],
)
def test_reshape_damaged_source_fails_cleanly(ckpt: Path, tmp_path: Path, damage, words: str) -> None:  # noqa: ANN001
    damage(ckpt)
    cli_error_line(runner.invoke(app, ["reshape", str(ckpt), str(tmp_path / "o")]), 1, "rank-00000.safetensors", words)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_reshape_bad_targets(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{bad")
    o = str(tmp_path / "o")
    cli_error_line(runner.invoke(app, ["reshape", str(ckpt), o, "--tp", "2"]), 2, "records no layout")
    cli_error_line(
        runner.invoke(app, ["reshape", str(ckpt), o, "--layout", str(tmp_path / "nofile.json")]), 2, "nofile.json"
    )
    cli_error_line(runner.invoke(app, ["reshape", str(ckpt), o, "--layout", str(tmp_path / "bad.json")]), 2, "bad.json")
    cli_error_line(runner.invoke(app, ["reshape", str(ckpt), str(ckpt)]), 2, "already exists")
    assert sorted(os.listdir(tmp_path)) == ["bad.json", "ck"]


def test_reshape_memory_budget_below_minimum(ckpt: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["reshape", str(ckpt), str(tmp_path / "o"), "--memory-budget", "512KiB"])
    cli_error_line(result, 2, "--memory-budget 512KiB", "at least 1 MiB")
    assert not (tmp_path / "o").exists()


def test_reshape_json_stays_json_when_verify_finds_problems(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = types.SimpleNamespace(kind="CorruptCheckpointError", message="tensor 'model.w': CRC-32C mismatch")
    monkeypatch.setattr(ucp, "verify", lambda path, **kw: types.SimpleNamespace(ok=False, problems=[bad]))
    result = runner.invoke(app, ["reshape", str(ckpt), str(tmp_path / "o"), "--verify", "--json"])
    assert result.exit_code == 1
    assert _strict_json(result.stdout)["verified"] is False


# -- help and the console script ----------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["inspect", "verify", "ls", "convert", "export", "reshape"])
def test_each_help(cmd: str) -> None:
    result = runner.invoke(app, [cmd, "--help"])
    assert result.exit_code == 0 and f"ucp {cmd}" in result.stdout


def test_console_script_bad_manifest_has_no_traceback(ckpt: Path) -> None:
    (ckpt / "manifest.json").write_text('{"format_version": 1, "creator": 5}')
    script = Path(sys.executable).with_name("ucp")
    done = subprocess.run([str(script), "verify", str(ckpt), "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr  # a damaged manifest: 1
    assert str(ckpt / "manifest.json") in done.stderr
    assert _strict_json(done.stdout)["exit_code"] == 1
