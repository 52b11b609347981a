"""One exit code per kind of failure, for every command: 2 bad input, 1 damaged data or failed work;
error lines carry the message alone (no class-name prefix)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner
from ucp_helpers import cli_error_line

import ucp
from reshard import LayoutError
from ucp.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, exit_code
from ucp.cli.main import app

runner = CliRunner()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    ucp.save({"model": {"w": torch.arange(8.0)}}, tmp_path / "ck")
    return tmp_path / "ck"


@pytest.mark.parametrize(
    "exc,code",
    [
        (ucp.NotACheckpointError("x"), EXIT_BAD_INPUT),
        (ucp.UnknownFormatError("x"), EXIT_BAD_INPUT),
        (ucp.UnsupportedFormatError("x"), EXIT_BAD_INPUT),
        (ucp.UnsafePickleError("f.pt", ["os.system"]), EXIT_BAD_INPUT),
        (ucp.ExportError("x"), EXIT_BAD_INPUT),
        (ucp.DestinationError("x"), EXIT_BAD_INPUT),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "f"), EXIT_BAD_INPUT),
        (LayoutError("x"), EXIT_BAD_INPUT),
        (ValueError("x"), EXIT_BAD_INPUT),
        (ucp.ManifestError("x"), EXIT_FAILED),
        (ucp.CorruptCheckpointError("x"), EXIT_FAILED),
        (ucp.MissingDataError("x"), EXIT_FAILED),
        (ucp.ForeignCheckpointError("x"), EXIT_FAILED),
        (ucp.CommitError("x", ranks=[1]), EXIT_FAILED),
        (ucp.BenchError("x"), EXIT_FAILED),
        (OSError(errno.EIO, "Input/output error"), EXIT_FAILED),
        (RuntimeError("x"), EXIT_FAILED),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_the_mapping(exc: BaseException, code: int) -> None:
    assert exit_code(exc) == code and exit_code(type(exc)) == code


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{missing}"],
        ["verify", "{missing}"],
        ["ls", "{missing}"],
        ["reshape", "{missing}", "{out}"],
        ["export", "{missing}", "{out}"],
        ["convert", "{missing}", "{out}"],
    ],
    ids=lambda a: a[0],
)
def test_a_missing_path_is_bad_input_saying_it_does_not_exist(tmp_path: Path, argv: list[str]) -> None:
    missing, out = tmp_path / "nope", tmp_path / "out"
    result = runner.invoke(app, [a.format(missing=missing, out=out) for a in argv])
    line = cli_error_line(result, 2, str(missing))
    assert "does not exist" in line or "no such file" in line.lower(), line
    assert "Error:" not in line.split(str(missing))[0]  # no "NotACheckpointError: " before the message
    assert not out.exists()


@pytest.mark.parametrize("cmd", ["inspect", "verify", "reshape", "export"])
def test_damaged_manifest_is_exit_1_with_the_message_alone(ckpt: Path, tmp_path: Path, cmd: str) -> None:
    (ckpt / "manifest.json").write_text("{ nope")
    argv = [cmd, str(ckpt)] + ([str(tmp_path / "out")] if cmd in ("reshape", "export") else [])
    line = cli_error_line(runner.invoke(app, argv), 1, str(ckpt / "manifest.json"), "not valid JSON")
    assert "ManifestError" not in line


def test_damaged_data_is_exit_1_for_reshape_without_class_prefix(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "rank-00000.safetensors").unlink()
    line = cli_error_line(runner.invoke(app, ["reshape", str(ckpt), str(tmp_path / "o")]), 1, "rank-00000.safetensors")
    assert not line.startswith("error: MissingDataError") and "Error:" not in line


def test_ls_of_a_checkpoint_says_it_is_one(ckpt: Path) -> None:
    line = cli_error_line(runner.invoke(app, ["ls", str(ckpt)]), 2, str(ckpt), "is a checkpoint")
    assert "ucp inspect" in line
    result = runner.invoke(app, ["ls", str(ckpt.parent), "--json"])  # its parent is a (non-manager) folder
    assert result.exit_code == 0 and json.loads(result.stdout)["checkpoints"] == []


def test_overwrite_hints_name_the_overwrite_option(ckpt: Path, tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    convert = runner.invoke(app, ["convert", str(tmp_path / "m.safetensors"), str(ckpt)])
    cli_error_line(convert, 2, "already exists", "--overwrite")
    reshape = runner.invoke(app, ["reshape", str(ckpt), str(ckpt)])
    cli_error_line(reshape, 2, "already exists", "--overwrite")
    again = runner.invoke(app, ["convert", str(tmp_path / "m.safetensors"), str(ckpt), "--overwrite", "--json"])
    assert again.exit_code == 0, again.output
    assert torch.equal(ucp.load(ckpt)["model"]["w"], torch.ones(2))


@pytest.mark.parametrize("argv", [["bench", "io"], ["bench", "save"], ["tune"]], ids=lambda a: "-".join(a))
def test_bench_and_tune_dir_must_exist(tmp_path: Path, argv: list[str]) -> None:
    missing = tmp_path / "not" / "there"
    cli_error_line(runner.invoke(app, [*argv, "--dir", str(missing)]), 2, f"--dir {missing} does not exist")
    assert not (tmp_path / "not").exists()
    (tmp_path / "file").write_text("x")
    cli_error_line(runner.invoke(app, [*argv, "--dir", str(tmp_path / "file")]), 2, "is not a directory")


def test_bench_does_not_drop_the_page_cache_unless_asked() -> None:
    from ucp.bench.io import BenchIoOptions
    from ucp.bench.save import BenchSaveOptions

    assert BenchIoOptions().drop_caches is False and BenchSaveOptions().drop_caches is False
    result = runner.invoke(app, ["bench", "io", "--help"])
    assert "--drop-caches" in result.stdout
