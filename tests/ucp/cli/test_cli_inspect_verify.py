"""``ucp inspect`` and ``ucp verify`` on real checkpoints: clean, corrupted, truncated, not a checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner
from ucp_helpers import random_tensor, save_ranks

import ucp
from ucp.cli.inspect import InspectReport
from ucp.cli.main import app
from ucp.cli.verify import VerifyOutput

runner = CliRunner()
W = random_tensor(torch.float32, (8, 6), seed=1)
F = random_tensor(torch.int64, (5, 7), seed=2)
B = random_tensor(torch.bfloat16, (3, 4), seed=3)


def _states() -> list[dict]:
    """Two ranks: W in row boxes, F in uneven flat ranges, B replicated, plain values."""
    cut = [0, 16, 35]
    return [
        {
            "model": {"w": ucp.ShardedTensor(W[r * 4 : (r + 1) * 4].clone(), (8, 6), (r * 4, 0)), "b": B.clone()},
            "optim": {
                "state": {
                    0: {"f": ucp.FlatShard(F.reshape(-1)[cut[r] : cut[r + 1]].clone(), (5, 7), cut[r]), "step": 7}
                },
                "param_groups": [{"lr": 0.5, "betas": (0.9, 0.95), "params": [0]}],
            },
            "epoch": float("inf"),
        }
        for r in range(2)
    ]


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "step-7"
    save_ranks(path, _states(), step=7, mesh={"dp": 2}, metadata={"run": "unit", "n": 3})
    return path


def _piece(manifest: ucp.Manifest, tensor: str, index: int = 0):
    return manifest.tensors[tensor].pieces[index]


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


# -- inspect --------------------------------------------------------------------------------------


def test_inspect_json_describes_everything(ckpt: Path) -> None:
    result = runner.invoke(app, ["inspect", str(ckpt), "--json"])
    assert result.exit_code == 0, result.output
    rep = InspectReport.model_validate(json.loads(result.stdout))
    m = ucp.read_manifest(ckpt)
    assert rep.format_version == ucp.FORMAT_VERSION and rep.step == 7 and rep.creator == m.creator
    assert rep.world_size == 2 and rep.mesh == {"dp": 2}
    assert rep.metadata == {"run": "unit", "n": 3}
    tensors = {t.name: t for t in rep.tensors}
    assert set(tensors) == {"model.w", "model.b", "optim.state.0.f"}
    w = tensors["model.w"]
    assert (w.dtype, w.shape, w.bytes, len(w.pieces)) == ("F32", [8, 6], 8 * 6 * 4, 2)
    assert sorted((p.box_offsets, p.box_shape) for p in w.pieces) == [([0, 0], [4, 6]), ([4, 0], [4, 6])]
    f = tensors["optim.state.0.f"]
    assert sorted((p.flat_start, p.flat_stop) for p in f.pieces) == [(0, 16), (16, 35)]
    assert all(p.box_offsets is None for p in f.pieces)
    assert len(tensors["model.b"].pieces) == 1  # replicated: written once
    for t in rep.tensors:  # offsets, lengths and CRCs exactly as in the manifest
        assert [(p.file, p.offset, p.length, p.crc32c) for p in t.pieces] == [
            (p.file, p.offset, p.length, p.crc32c) for p in m.tensors[t.name].pieces
        ]
    assert rep.tensor_bytes == 8 * 6 * 4 + 5 * 7 * 8 + 3 * 4 * 2 and rep.piece_count == 5
    assert rep.dtypes == {"F32": 192, "I64": 280, "BF16": 24}
    sizes = {f.name: f.size for f in rep.files}
    assert sizes == {name: os.path.getsize(ckpt / name) for name in os.listdir(ckpt) if name != "manifest.json"}
    assert rep.file_bytes == sum(sizes.values())
    assert sum(f.tensor_bytes for f in rep.files) == rep.tensor_bytes
    state = {v.path: (v.type, v.value) for v in rep.state}
    assert state["optim.state.0.step"] == ("int", 7)
    assert state["optim.param_groups[0].lr"] == ("float", 0.5)
    assert state["optim.param_groups[0].betas"] == ("tuple[2]", [0.9, 0.95])
    assert state["optim.param_groups[0].params"] == ("list[1]", [0])
    assert state["epoch"] == ("float", "inf")


def test_inspect_table_and_tensor_filter(ckpt: Path) -> None:
    result = runner.invoke(app, ["inspect", str(ckpt)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    for needle in (
        "model.w",
        "optim.state.0.f",
        "rank-00000.safetensors",
        "[4:8, 0:6]",
        "flat[16:35)",
        "step 7",
        "world size 2",
        "dp=2",
        '"run": "unit"',
        "optim.param_groups[0].lr",
    ):
        assert needle in text, needle
    only = runner.invoke(app, ["inspect", str(ckpt), "--json", "--tensor", "model.*"])
    assert only.exit_code == 0, only.output
    assert sorted(t["name"] for t in json.loads(only.stdout)["tensors"]) == ["model.b", "model.w"]


def test_inspect_and_verify_fsspec_url() -> None:
    url = "memory://ucp-cli-test/run/step-3"
    ucp.save({"w": W.clone(), "step": 3}, url, step=3)
    result = runner.invoke(app, ["inspect", url, "--json"])
    assert result.exit_code == 0, result.output
    rep = InspectReport.model_validate(json.loads(result.stdout))
    assert rep.step == 3 and [t.name for t in rep.tensors] == ["w"] and rep.path == url
    ok = runner.invoke(app, ["verify", url, "--json"])
    assert ok.exit_code == 0, ok.output
    assert VerifyOutput.model_validate(json.loads(ok.stdout)).ok


@pytest.mark.parametrize("case", ["missing", "not-json", "schema", "version", "data-file"])
def test_inspect_bad_input_exits_with_one_line(tmp_path: Path, ckpt: Path, case: str) -> None:
    """Bad input (missing, not a checkpoint, an unknown format version) exits 2; a damaged manifest 1."""
    target = tmp_path / "bad"
    target.mkdir()
    manifest = target / "manifest.json"
    if case == "not-json":
        manifest.write_text("{ nope")
    elif case == "schema":
        manifest.write_text(json.dumps({"format_version": 1, "creator": "x"}))
    elif case == "version":
        manifest.write_text(json.dumps({"format_version": 99}))
    elif case == "data-file":
        target = ckpt / "rank-00000.safetensors"
    result = runner.invoke(app, ["inspect", str(target)])
    assert result.exit_code == (1 if case in ("not-json", "schema") else 2), result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    named = str(target) if case in ("missing", "data-file") else str(manifest)
    assert named in lines[0]
    if case == "version":
        assert "format_version 99" in lines[0]


# -- verify ---------------------------------------------------------------------------------------


def test_verify_clean_checkpoint(ckpt: Path) -> None:
    result = runner.invoke(app, ["verify", str(ckpt)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK ") and "2 files" in result.stdout and "5 pieces" in result.stdout
    js = runner.invoke(app, ["verify", str(ckpt), "--json"])
    assert js.exit_code == 0, js.output
    out = VerifyOutput.model_validate(json.loads(js.stdout))
    assert out.ok and out.exit_code == 0 and out.problems == []
    assert out.files_checked == 2 and out.pieces_checked == 5 and out.tensors == 3 and out.step == 7
    assert out.bytes_checked == sum(os.path.getsize(ckpt / n) for n in os.listdir(ckpt) if n != "manifest.json")


def test_verify_flipped_byte_names_tensor_file_and_offset(ckpt: Path) -> None:
    piece = _piece(ucp.read_manifest(ckpt), "optim.state.0.f", 1)
    _flip_byte(ckpt / piece.file, piece.offset + 9)
    result = runner.invoke(app, ["verify", str(ckpt)])
    assert result.exit_code == 1, result.output
    assert "PROBLEMS" in result.stdout
    assert "'optim.state.0.f'" in result.stdout and repr(piece.file) in result.stdout and "CRC-32C" in result.stdout
    js = runner.invoke(app, ["verify", str(ckpt), "--json"])
    assert js.exit_code == 1
    out = VerifyOutput.model_validate(json.loads(js.stdout))
    assert not out.ok and out.exit_code == 1 and out.files_checked == 1
    [p] = out.problems
    assert (p.kind, p.tensor, p.file, p.offset) == (
        "CorruptCheckpointError",
        "optim.state.0.f",
        piece.file,
        piece.offset,
    )


def test_verify_truncated_file(ckpt: Path) -> None:
    m = ucp.read_manifest(ckpt)
    victim = _piece(m, "model.w", 0).file
    size = m.files[victim].size
    os.truncate(ckpt / victim, size - 100)
    result = runner.invoke(app, ["verify", str(ckpt)])
    assert result.exit_code == 1, result.output
    assert "truncated" in result.stdout and repr(victim) in result.stdout
    assert f"{size - 100} bytes" in result.stdout and str(size) in result.stdout
    out = VerifyOutput.model_validate(json.loads(runner.invoke(app, ["verify", str(ckpt), "--json"]).stdout))
    assert out.exit_code == 1 and [p.file for p in out.problems] == [victim]


def test_verify_missing_data_file(ckpt: Path) -> None:
    (ckpt / "rank-00001.safetensors").unlink()
    result = runner.invoke(app, ["verify", str(ckpt)])
    assert result.exit_code == 1, result.output
    assert "MissingDataError" in result.stdout and "rank-00001.safetensors" in result.stdout


def test_verify_missing_or_damaged_input(tmp_path: Path, ckpt: Path) -> None:
    result = runner.invoke(app, ["verify", str(tmp_path / "nothing-here")])
    assert result.exit_code == 2, result.output
    assert "does not exist" in result.output and "Traceback" not in result.output
    (ckpt / "manifest.json").write_text('{"format_version": 1, "creator": 5}')
    js = runner.invoke(app, ["verify", str(ckpt), "--json"])
    assert js.exit_code == 1  # a damaged manifest
    out = VerifyOutput.model_validate(json.loads(js.stdout))
    assert out.exit_code == 1 and out.problems[0].kind == "ManifestError"
    assert str(ckpt / "manifest.json") in out.problems[0].message


def test_help_lists_inspect_and_verify() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "inspect" in result.stdout and "verify" in result.stdout


def test_verify_shows_byte_progress_on_a_terminal(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal, ucp.verify's progress callback drives a bar over bytes on stderr."""
    import io

    from rich.console import Console

    import ucp.cli.verify as cli_verify

    seen: list[tuple[int, int]] = []
    real = ucp.verify

    def spy(path, *, progress=None, **kw):
        assert progress is not None, "the CLI passes a progress callback"

        def counting(done: int, total: int) -> None:
            seen.append((done, total))
            progress(done, total)

        return real(path, progress=counting, **kw)

    monkeypatch.setattr(ucp, "verify", spy)
    monkeypatch.setattr(cli_verify, "err", Console(file=io.StringIO(), force_terminal=True, width=100))
    result = runner.invoke(app, ["verify", str(ckpt)])
    assert result.exit_code == 0, result.output
    total = sum(os.path.getsize(ckpt / n) for n in os.listdir(ckpt) if n != "manifest.json")
    assert seen and seen[-1] == (total, total)
