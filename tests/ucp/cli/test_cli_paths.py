"""Where ``ucp convert`` / ``ucp export`` write, and what they refuse: URL destinations, a destination
that is or holds the source, symlinked destinations (the link is replaced, its target never touched),
and foreign files that are not torch archives at all. Each refusal is exit 2 naming the path at fault
and leaves the disk as it was."""

from __future__ import annotations

import fractions
import os
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner
from ucp_helpers import cli_error_line

import ucp
from ucp.cli.main import app
from ucp.conversion.importers import ForeignCheckpointError, UnknownFormatError, UnsafePickleError
from ucp.conversion.importers.hf import read_hf
from ucp.conversion.importers.pickles import load_torch, load_torch_bytes
from ucp.store.storage import LocalStorage

runner = CliRunner()
W = torch.arange(12.0).reshape(3, 4)


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    ucp.save({"model": {"w": W.clone()}, "step": 3}, path, step=3)
    return path


@pytest.fixture()
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2, 3)}, path)
    return path


@pytest.fixture()
def mem_url():
    root = f"/ucp-test-paths-{uuid.uuid4().hex}"
    yield f"memory://{root}/ck"
    try:
        fsspec.filesystem("memory").rm(root, recursive=True)
    except FileNotFoundError:
        pass


# -- convert: URLs ------------------------------------------------------------------------------------


def test_convert_writes_a_url_destination_through_ucp_save(
    weights: Path, tmp_path: Path, mem_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    result = runner.invoke(app, ["convert", str(weights), mem_url, "--json"])
    assert result.exit_code == 0, result.stderr
    assert mem_url in result.stdout
    assert torch.equal(ucp.load(mem_url)["model"]["w"], torch.ones(2, 3)) and ucp.verify(mem_url).ok
    assert sorted(os.listdir(tmp_path)) == before  # nothing written locally

    cli_error_line(runner.invoke(app, ["convert", str(weights), mem_url]), 2, mem_url, "already exists")
    save_file({"w": torch.zeros(5)}, tmp_path / "m2.safetensors")
    again = runner.invoke(app, ["convert", str(tmp_path / "m2.safetensors"), mem_url, "--force"])
    assert again.exit_code == 0, again.stderr
    assert torch.equal(ucp.load(mem_url)["model"]["w"], torch.zeros(5))


def test_convert_force_never_replaces_a_non_checkpoint_url(weights: Path, mem_url: str) -> None:
    fs = fsspec.filesystem("memory")
    path = mem_url.removeprefix("memory://")
    fs.pipe(f"{path}/keep.txt", b"keep")
    cli_error_line(
        runner.invoke(app, ["convert", str(weights), mem_url, "--force"]), 2, mem_url, "not a UCP checkpoint"
    )
    assert fs.cat(f"{path}/keep.txt") == b"keep"


def test_convert_url_source_is_refused_as_given(tmp_path: Path) -> None:
    url = "memory://ucp-test-paths/src"
    cli_error_line(runner.invoke(app, ["convert", url, str(tmp_path / "out")]), 2, repr(url), "local paths only")
    assert not (tmp_path / "out").exists()


def test_convert_unknown_protocol_destination_names_it(weights: Path) -> None:
    cli_error_line(runner.invoke(app, ["convert", str(weights), "nosuchproto://b/x"]), 2, "nosuchproto://b/x")


# -- convert / export: destination overlapping the source ---------------------------------------------


def test_convert_force_refuses_a_destination_holding_the_source(ckpt: Path) -> None:
    src = ckpt / "extra.safetensors"
    save_file({"w": torch.ones(2)}, src)
    before = sorted(os.listdir(ckpt))
    cli_error_line(runner.invoke(app, ["convert", str(src), str(ckpt), "--force"]), 2, str(ckpt), "delete the source")
    assert sorted(os.listdir(ckpt)) == before and ucp.verify(ckpt).ok


@pytest.mark.parametrize("where", ["same", "parent", "inside", "link-to-source"])
def test_export_refuses_a_destination_overlapping_the_source(ckpt: Path, tmp_path: Path, where: str) -> None:
    dst = {"same": ckpt, "parent": tmp_path, "inside": ckpt / "hf", "link-to-source": tmp_path / "link"}[where]
    if where == "link-to-source":
        os.symlink("ck", dst)
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(ckpt))
    cli_error_line(runner.invoke(app, ["export", str(ckpt), str(dst), "--overwrite"]), 2, str(dst), "source")
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(ckpt))) == before
    assert ucp.verify(ckpt).ok


# -- symlinked destinations: the link is replaced, its target left as it was ---------------------------


def test_export_overwrite_replaces_the_link_not_its_target(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "target").mkdir(parents=True)
    (out / "target" / "keep.txt").write_text("keep")
    os.symlink("target", out / "link")
    result = runner.invoke(app, ["export", str(ckpt), str(out / "link"), "--overwrite"])
    assert result.exit_code == 0, result.stderr
    assert sorted(os.listdir(out)) == ["link", "target"]
    assert not (out / "link").is_symlink() and (out / "link" / "model.safetensors").is_file()
    assert sorted(os.listdir(out / "target")) == ["keep.txt"]


def test_convert_force_onto_a_link_leaves_the_old_checkpoint_intact(ckpt: Path, weights: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    os.rename(ckpt, out / "real")
    os.symlink("real", out / "link")
    result = runner.invoke(app, ["convert", str(weights), str(out / "link"), "--force"])
    assert result.exit_code == 0, result.stderr
    assert sorted(os.listdir(out)) == ["link", "real"] and not (out / "link").is_symlink()
    assert torch.equal(ucp.load(out / "link")["model"]["w"], torch.ones(2, 3))
    assert ucp.verify(out / "real").ok and torch.equal(ucp.load(out / "real")["model"]["w"], W)


def test_convert_dangling_link_destination_is_refused(weights: Path, tmp_path: Path) -> None:
    os.symlink("nowhere", tmp_path / "link")
    cli_error_line(runner.invoke(app, ["convert", str(weights), str(tmp_path / "link")]), 2, "already exists")
    assert os.readlink(tmp_path / "link") == "nowhere"


def test_local_remove_tree_unlinks_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    os.symlink("real", tmp_path / "link")
    LocalStorage(str(tmp_path)).remove_tree("link")
    assert sorted(os.listdir(tmp_path)) == ["real"] and (tmp_path / "real" / "f").read_text() == "x"


# -- export --chunk-mb --------------------------------------------------------------------------------


def test_export_chunk_mb_below_one_byte_is_refused(ckpt: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["export", str(ckpt), str(tmp_path / "o"), "--format", "zarr", "--chunk-mb", "1e-9"])
    cli_error_line(result, 2, "--chunk-mb")
    assert not (tmp_path / "o").exists()


# -- foreign torch files ------------------------------------------------------------------------------


def test_not_a_torch_archive_is_never_unpickled(tmp_path: Path) -> None:
    bad = tmp_path / "x.pt"
    bad.write_bytes(b"\x80\x02garbage that is a pickle header and nothing else")
    for trust in (False, True):
        with pytest.raises(ForeignCheckpointError, match="is not a readable torch.save archive") as info:
            load_torch(bad, trust_pickle=trust)
        assert not isinstance(info.value, UnsafePickleError) and info.value.file == str(bad)
    with pytest.raises(ForeignCheckpointError, match="item 7 is not a readable torch.save archive"):
        load_torch_bytes(b"garbage", where="item 7", trust_pickle=True)


def test_trusted_legacy_archive_loads_without_mmap(tmp_path: Path) -> None:
    """A legacy (non-zip) archive needing a global outside the allow-list: refused, then fully unpickled."""
    path = tmp_path / "legacy.pt"
    torch.save({"w": W, "f": fractions.Fraction(1, 3)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafePickleError):
        load_torch(path)
    loaded = load_torch(path, trust_pickle=True)
    assert torch.equal(loaded["w"], W) and loaded["f"] == fractions.Fraction(1, 3)


def test_trusted_damaged_archive_is_a_foreign_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": W, "f": fractions.Fraction(1, 3)}, path, _use_new_zipfile_serialization=False)
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ForeignCheckpointError, match="legacy.pt"):
        load_torch(path, trust_pickle=True)


def test_read_hf_refuses_a_ucp_checkpoint(ckpt: Path) -> None:
    with pytest.raises(UnknownFormatError, match="UCP checkpoint already"):
        read_hf(ckpt)
