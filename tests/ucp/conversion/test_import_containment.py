"""Importers read only the files of the source they were given: a file the source names (a Hugging
Face index shard, a DCP data file, a DeepSpeed tag folder) that is a symbolic link resolving outside
the source folder is refused with an error naming the file and where it points."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ucp
from ucp.conversion.importers import ForeignCheckpointError, convert


def _hf_sharded(folder: Path) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True)
    a = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    b = {"b.bias": torch.ones(5, dtype=torch.bfloat16)}
    save_file(a, folder / "model-00001-of-00002.safetensors")
    save_file(b, folder / "model-00002-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors"},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return a | b


def _link_out(file: Path, outside: Path) -> Path:
    outside.mkdir(parents=True, exist_ok=True)
    target = outside / file.name
    shutil.move(file, target)
    os.symlink(target, file)
    return target


def test_hf_index_shard_linked_outside_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    _hf_sharded(src)
    shard = src / "model-00002-of-00002.safetensors"
    target = _link_out(shard, tmp_path / "elsewhere")
    with pytest.raises(ForeignCheckpointError) as info:
        convert(src, tmp_path / "out")
    msg = str(info.value)
    assert str(shard) in msg and str(target) in msg and "outside the source checkpoint folder" in msg
    assert info.value.file == str(shard)
    assert not (tmp_path / "out").exists()


def test_hf_index_given_as_a_file_checks_its_shards(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    _hf_sharded(src)
    target = _link_out(src / "model-00001-of-00002.safetensors", tmp_path / "elsewhere")
    with pytest.raises(ForeignCheckpointError, match="outside the source checkpoint folder") as info:
        convert(src / "model.safetensors.index.json", tmp_path / "out")
    assert str(target) in str(info.value)


def test_hf_index_file_linked_outside_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    _hf_sharded(src)
    index = src / "model.safetensors.index.json"
    target = tmp_path / "elsewhere" / index.name
    target.parent.mkdir()
    shutil.copy(index, target)
    index.unlink()
    os.symlink(target, index)
    with pytest.raises(ForeignCheckpointError, match="outside the source checkpoint folder"):
        convert(src, tmp_path / "out")


def test_hf_shard_linked_inside_the_source_converts(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    tensors = _hf_sharded(src)
    shard = src / "model-00001-of-00002.safetensors"
    (src / "blobs").mkdir()
    shutil.move(shard, src / "blobs" / shard.name)
    os.symlink(Path("blobs") / shard.name, shard)
    convert(src, tmp_path / "out")
    loaded = ucp.load(tmp_path / "out")["model"]
    assert torch.equal(loaded["a.weight"], tensors["a.weight"])
    assert torch.equal(loaded["b.bias"], tensors["b.bias"])


def test_dcp_data_file_linked_outside_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is intended here
        dcp.save({"w": torch.arange(8, dtype=torch.float32)}, checkpoint_id=str(src))
    (data,) = [p for p in src.iterdir() if p.name.endswith(".distcp")]
    target = _link_out(data, tmp_path / "elsewhere")
    with pytest.raises(ForeignCheckpointError, match="outside the source checkpoint folder") as info:
        convert(src, tmp_path / "out")
    assert str(target) in str(info.value) and data.name in str(info.value)


def test_deepspeed_tag_folder_linked_outside_is_refused(tmp_path: Path) -> None:
    """``latest`` names a plain folder name, but that folder may itself be a link leading out."""
    src = tmp_path / "ds"
    src.mkdir()
    outside = tmp_path / "elsewhere" / "global_step3"
    outside.mkdir(parents=True)
    (outside / "mp_rank_00_model_states.pt").write_bytes(b"")
    (outside / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    os.symlink(outside, src / "global_step3")
    (src / "latest").write_text("global_step3")
    with pytest.raises(ForeignCheckpointError, match="outside the source checkpoint folder") as info:
        convert(src, tmp_path / "out")
    assert str(outside) in str(info.value)
