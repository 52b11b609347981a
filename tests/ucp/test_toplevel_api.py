"""``ucp.reshape``, ``ucp.convert``, ``ucp.export``: functions with the command line's options, writing what
the commands write; errors are ucp errors; ``ucp.convert`` stays the function whatever is imported; the
names resolve without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import ucp
from ucp.cli.main import app

runner = CliRunner()


def _data_files(path: Path) -> dict[str, bytes]:
    """Every file of a checkpoint or export folder but the manifest (which holds its creation time)."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file() and p.name != "manifest.json"}


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {"a.weight": torch.randn(8, 6, generator=g), "b.weight": torch.randn(5, generator=g)},
        "optimizer": {"exp_avg": {"a.weight": torch.randn(8, 6, generator=g)}},
        "step": 3,
    }
    path = tmp_path / "src"
    ucp.save(state, path, step=3)
    return path


def test_reshape_writes_what_the_command_writes(ckpt: Path, tmp_path: Path) -> None:
    report = ucp.reshape(ckpt, tmp_path / "fn", dp=2, zero=1, memory_budget="4MiB", verify=True)
    res = runner.invoke(
        app, ["reshape", str(ckpt), str(tmp_path / "cli"), "--dp", "2", "--zero", "1", "--memory-budget", "4MiB"]
    )
    assert res.exit_code == 0, res.output
    assert report.files == len(ucp.read_manifest(tmp_path / "fn").files)
    assert _data_files(tmp_path / "fn") == _data_files(tmp_path / "cli")
    assert ucp.read_manifest(tmp_path / "fn").tensors == ucp.read_manifest(tmp_path / "cli").tensors
    want = ucp.load(ckpt)
    got = ucp.load(tmp_path / "fn")
    assert torch.equal(got["model"]["a.weight"], want["model"]["a.weight"]) and got["step"] == 3


def test_reshape_consolidates_without_a_target(ckpt: Path, tmp_path: Path) -> None:
    ucp.reshape(ckpt, tmp_path / "dp2", dp=2, zero=1)
    ucp.reshape(tmp_path / "dp2", tmp_path / "one")
    manifest = ucp.read_manifest(tmp_path / "one")
    assert all(len(e.pieces) == 1 for e in manifest.tensors.values())


def test_reshape_bad_options_are_ucp_errors(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ucp.LayoutMismatchError, match=r"records no layout.*--tp 2"):
        ucp.reshape(ckpt, tmp_path / "o", tp=2)
    with pytest.raises(ucp.LayoutMismatchError, match=r"memory_budget.*at least 1 MiB"):
        ucp.reshape(ckpt, tmp_path / "o", memory_budget="1KiB")
    with pytest.raises(ucp.NotACheckpointError):
        ucp.reshape(tmp_path / "nope", tmp_path / "o", dp=2)
    ucp.reshape(ckpt, tmp_path / "o")
    with pytest.raises(ucp.DestinationError):
        ucp.reshape(ckpt, tmp_path / "o")


def test_convert_writes_what_the_command_writes(tmp_path: Path) -> None:
    tensors = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(3, dtype=torch.int32)}
    save_file(tensors, tmp_path / "model.safetensors")
    report = ucp.convert(tmp_path / "model.safetensors", tmp_path / "fn", source_format="hf")
    res = runner.invoke(app, ["convert", str(tmp_path / "model.safetensors"), str(tmp_path / "cli"), "--from", "hf"])
    assert res.exit_code == 0, res.output
    assert report.tensors == 2
    assert _data_files(tmp_path / "fn") == _data_files(tmp_path / "cli")
    fn, cli = ucp.load(tmp_path / "fn"), ucp.load(tmp_path / "cli")
    assert fn.keys() == cli.keys()
    with pytest.raises(ucp.DestinationError):
        ucp.convert(tmp_path / "model.safetensors", tmp_path / "fn", source_format="hf")
    with pytest.raises(ucp.UnknownFormatError):
        ucp.convert(tmp_path / "model.safetensors", tmp_path / "x", source_format="megatron")


def test_export_writes_what_the_command_writes(ckpt: Path, tmp_path: Path) -> None:
    report = ucp.export(ckpt, tmp_path / "fn", format="hf", dtype="bf16", max_shard_size="100B")
    res = runner.invoke(
        app,
        ["export", str(ckpt), str(tmp_path / "cli"), "--format", "hf", "--dtype", "bf16", "--max-shard-size", "100B"],
    )
    assert res.exit_code == 0, res.output
    assert report.dtype is not None and len(report.files) > 1
    assert _data_files(tmp_path / "fn") == _data_files(tmp_path / "cli")
    with pytest.raises(ucp.ExportError, match="--max-shard-size|max_shard_size"):
        ucp.export(ckpt, tmp_path / "bad", max_shard_size="lots")
    with pytest.raises(ucp.ExportError):
        ucp.export(ckpt, ckpt / "inside")  # the destination lies inside the source


def test_convert_stays_the_function_after_the_package_is_imported() -> None:
    import ucp.conversion.importers  # sets ucp.conversion, never ucp.convert
    from ucp.conversion.api import convert

    assert ucp.convert is convert
    assert ucp.conversion.importers.convert is not None


def test_the_names_resolve_without_torch() -> None:
    code = (
        "import sys, ucp\n"
        "for n in ('reshape', 'export', 'convert', 'read_manifest'): getattr(ucp, n)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "import ucp.cli.main\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_memory_budget_matches_the_reshaper() -> None:
    from ucp.conversion import api, reshape

    assert api.DEFAULT_MEMORY_BUDGET == reshape.DEFAULT_MEMORY_BUDGET
