"""``ucp export``: hf and zarr outputs through the CLI, JSON report, and clear errors with exit codes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner, Result
from ucp_helpers import random_tensor, same_bytes, save_ranks
from zarr_checks import array, open_group

import ucp
from ucp.cli.main import app
from ucp.conversion.exporters import ExportReport
from ucp.conversion.exporters.zarr_export import read_tensor

runner = CliRunner()
W = random_tensor(torch.float32, (16, 8), seed=1)
B = random_tensor(torch.bfloat16, (8, 4), seed=2)
N = random_tensor(torch.int64, (3,), seed=3)


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    """2 ranks: W in row shards, B replicated, N a plain int tensor; an optimizer section besides the model."""
    states = [
        {
            "model": {
                "w": ucp.ShardedTensor(W[r * 8 : (r + 1) * 8].clone(), (16, 8), (r * 8, 0)),
                "b": B.clone(),
                "n": N.clone(),
            },
            "optimizer": {
                "exp_avg": {"w": ucp.FlatShard(W.reshape(-1)[r * 64 : (r + 1) * 64].clone(), (16, 8), r * 64)}
            },
            "step": 4,
        }
        for r in range(2)
    ]
    save_ranks(tmp_path / "step-4", states, step=4, mesh={"dp": 2})
    return tmp_path / "step-4"


def _invoke(*args: str | Path) -> Result:
    return runner.invoke(app, ["export", *map(str, args)])


def test_hf_json_report(ckpt: Path, tmp_path: Path) -> None:
    result = _invoke(
        ckpt, tmp_path / "hf", "--format", "hf", "--max-shard-size", "550B", "--memory-budget", "1KiB", "--json"
    )
    assert result.exit_code == 0, result.output
    report = ExportReport.model_validate(json.loads(result.stdout))
    assert report.format == "hf" and report.tensors == 3 and report.section == "model"
    assert report.files[-1] == "model.safetensors.index.json" and len(report.files) == 3  # w alone, then b + n
    got = {}
    for f in report.files[:-1]:
        got.update(load_file(tmp_path / "hf" / f))
    assert same_bytes(got["w"], W) and same_bytes(got["b"], B) and same_bytes(got["n"], N)


def test_hf_cast_and_section_text_output(ckpt: Path, tmp_path: Path) -> None:
    result = _invoke(ckpt, tmp_path / "hf", "--section", "optimizer", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert "exported section 'optimizer'" in result.stdout and "cast to bfloat16" in result.stdout
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert list(got) == ["exp_avg.w"] and same_bytes(got["exp_avg.w"], W.to(torch.bfloat16))


def test_zarr(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.zarr"
    result = _invoke(
        ckpt,
        out,
        "--format",
        "zarr",
        "--compressor",
        "blosc",
        "--level",
        "3",
        "--chunk-mb",
        "0.0002",
        "--section",
        "all",
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = ExportReport.model_validate(json.loads(result.stdout))
    assert sorted(report.files) == ["model.b", "model.n", "model.w", "optimizer.exp_avg.w"]
    group = open_group(out)
    w = array(group, "model.w")
    assert w.chunks == (6, 8)  # 0.0002 MiB = 209 B: 6 rows of 32 B
    codecs = json.loads((out / "model.w" / "zarr.json").read_text())["codecs"]
    assert codecs[1]["name"] == "blosc" and codecs[1]["configuration"]["clevel"] == 3
    assert same_bytes(read_tensor(w), W) and same_bytes(read_tensor(group["model.b"]), B)
    assert same_bytes(read_tensor(group["optimizer.exp_avg.w"]), W)


def test_errors_name_what_is_wrong(ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    r = _invoke(ckpt, dst, "--section", "optim")
    assert r.exit_code == 2 and "section 'optim' is not in the checkpoint" in r.stderr and "'optimizer'" in r.stderr
    r = _invoke(ckpt, dst, "--dtype", "bf8")
    assert r.exit_code == 2 and "unknown dtype 'bf8'" in r.stderr
    r = _invoke(ckpt, dst, "--max-shard-size", "2XB")
    assert r.exit_code == 2 and "--max-shard-size: cannot read '2XB' as a size" in r.stderr
    r = _invoke(ckpt, dst, "--compressor", "blosc")
    assert r.exit_code == 2 and "--compressor apply to --format zarr only" in r.stderr
    r = _invoke(tmp_path / "nothing", dst)
    assert r.exit_code == 2 and "nothing" in r.stderr
    assert not dst.exists()
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    r = _invoke(ckpt, dst)
    assert r.exit_code == 2 and "exists and is not empty" in r.stderr and str(dst) in r.stderr
    assert os.listdir(dst) == ["keep.txt"]
    r = _invoke(ckpt, dst, "--overwrite")
    assert r.exit_code == 0, r.output
    assert os.listdir(dst) == ["model.safetensors"]


def test_corrupt_checkpoint_fails_and_leaves_dst_alone(ckpt: Path, tmp_path: Path) -> None:
    piece = ucp.read_manifest(ckpt).tensors["model.b"].pieces[0]
    with open(ckpt / piece.file, "r+b") as f:
        f.seek(piece.offset)
        first = f.read(1)
        f.seek(piece.offset)
        f.write(bytes([first[0] ^ 0x80]))
    r = _invoke(ckpt, tmp_path / "hf")
    assert r.exit_code == 1 and "model.b" in r.stderr and piece.file in r.stderr, r.output
    assert sorted(os.listdir(tmp_path)) == ["step-4"]
    r = _invoke(ckpt, tmp_path / "hf", "--no-verify", "--json")
    assert r.exit_code == 0, r.output
