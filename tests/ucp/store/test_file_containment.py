"""A checkpoint's files must be the checkpoint's: a manifest or data file that is a symbolic link
resolving outside the checkpoint directory is refused by load, partial load, verify, reshape and
export, with an error naming the file and where it points. Links inside the directory keep working."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import ucp
from ucp.conversion.exporters import export
from ucp.conversion.reshape import reshape


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    state = {"model": {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(8)}}
    path = tmp_path / "ckpt"
    ucp.save(state, path)
    return path, state


def _data_file(ckpt: Path) -> Path:
    (file,) = [p for p in ckpt.iterdir() if p.name.endswith(".safetensors")]
    return file


def _link_out(file: Path, outside: Path) -> Path:
    """Move ``file`` to ``outside`` (same bytes) and leave a symlink in its place."""
    outside.mkdir(parents=True, exist_ok=True)
    target = outside / file.name
    shutil.move(file, target)
    os.symlink(target, file)
    return target


def test_data_file_linked_outside_is_refused_by_load(tmp_path: Path) -> None:
    ckpt, _ = _checkpoint(tmp_path)
    file = _data_file(ckpt)
    target = _link_out(file, tmp_path / "elsewhere")
    with pytest.raises(ucp.CheckpointError) as info:
        ucp.load(ckpt)
    msg = str(info.value)
    assert file.name in msg and str(target) in msg and "outside the checkpoint directory" in msg


def test_data_file_linked_outside_is_refused_by_partial_load(tmp_path: Path) -> None:
    ckpt, state = _checkpoint(tmp_path)
    target = _link_out(_data_file(ckpt), tmp_path / "elsewhere")
    into = {"model": {"w": torch.zeros(8, 8), "b": torch.zeros(8)}}
    with pytest.raises(ucp.CheckpointError, match="outside the checkpoint directory") as info:
        ucp.load(ckpt, into=into)
    assert str(target) in str(info.value)
    assert torch.equal(into["model"]["w"], torch.zeros(8, 8))  # nothing foreign was copied in


def test_manifest_linked_outside_is_refused(tmp_path: Path) -> None:
    ckpt, _ = _checkpoint(tmp_path)
    target = _link_out(ckpt / "manifest.json", tmp_path / "elsewhere")
    with pytest.raises(ucp.CheckpointError, match="manifest.json") as info:
        ucp.load(ckpt)
    assert str(target) in str(info.value)
    report = ucp.verify(ckpt)
    assert not report.ok
    assert any(str(target) in p.message for p in report.problems)


def test_verify_reports_a_data_file_linked_outside(tmp_path: Path) -> None:
    ckpt, _ = _checkpoint(tmp_path)
    file = _data_file(ckpt)
    target = _link_out(file, tmp_path / "elsewhere")
    report = ucp.verify(ckpt)
    assert not report.ok
    assert report.files_checked == 0
    (problem,) = report.problems
    assert str(target) in problem.message and file.name in problem.message


def test_directory_link_inside_the_checkpoint_escaping_is_refused(tmp_path: Path) -> None:
    """The link may sit anywhere on the way: a sub-folder link leading out is refused too."""
    ckpt, _ = _checkpoint(tmp_path)
    file = _data_file(ckpt)
    outside = tmp_path / "elsewhere"
    _link_out(file, outside)
    os.unlink(file)
    os.symlink(outside, ckpt / "sub")
    os.symlink(Path("sub") / file.name, file)  # relative link into a folder link that leaves the checkpoint
    with pytest.raises(ucp.CheckpointError, match="outside the checkpoint directory"):
        ucp.load(ckpt)


def test_reshape_and_export_refuse_a_data_file_linked_outside(tmp_path: Path) -> None:
    ckpt, _ = _checkpoint(tmp_path)
    target = _link_out(_data_file(ckpt), tmp_path / "elsewhere")
    with pytest.raises(ucp.CheckpointError, match="outside the checkpoint directory") as info:
        reshape(ckpt, tmp_path / "reshaped")
    assert str(target) in str(info.value)
    assert not (tmp_path / "reshaped").exists()
    with pytest.raises(ucp.CheckpointError, match="outside the checkpoint directory"):
        export(ckpt, tmp_path / "exported", format="hf")


def test_links_inside_the_checkpoint_keep_working(tmp_path: Path) -> None:
    ckpt, state = _checkpoint(tmp_path)
    file = _data_file(ckpt)
    (ckpt / "blobs").mkdir()
    shutil.move(file, ckpt / "blobs" / file.name)
    os.symlink(Path("blobs") / file.name, file)  # relative, stays inside
    loaded = ucp.load(ckpt)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["model"]["b"], state["model"]["b"])
    assert ucp.verify(ckpt).ok


def test_a_checkpoint_reached_through_a_link_loads(tmp_path: Path) -> None:
    """The checkpoint directory itself may be a link (a ``latest`` alias): containment is judged inside it."""
    ckpt, state = _checkpoint(tmp_path)
    alias = tmp_path / "alias"
    os.symlink(ckpt, alias)
    assert torch.equal(ucp.load(alias)["model"]["w"], state["model"]["w"])
    assert ucp.verify(alias).ok
