"""Hugging Face safetensors weights imported into UCP: one file, a sharded set with its index, a folder."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ucp
from ucp.conversion.importers import ForeignCheckpointError, convert, detect


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(11, 8, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).half(),
        "model.norm.weight": torch.randn(8, generator=g),
        "lm_head.bias": torch.randn(3, generator=g).double(),
        "position_ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def _check(dst: Path, want: dict[str, torch.Tensor]) -> None:
    got = ucp.load(dst)
    assert list(got) == ["model"] and sorted(got["model"]) == sorted(want)
    for name, t in want.items():
        assert got["model"][name].dtype == t.dtype and torch.equal(got["model"][name], t), name
    assert ucp.read_manifest(dst).metadata["source"]["format"] == "hf"


def test_single_file(tmp_path: Path) -> None:
    w = _weights()
    save_file(w, tmp_path / "model.safetensors")
    assert detect(tmp_path / "model.safetensors") == "hf" and detect(tmp_path) == "hf"
    report = convert(tmp_path / "model.safetensors", tmp_path / "out")
    assert report.format == "hf" and report.tensors == len(w) and report.step is None
    _check(tmp_path / "out", w)


def _sharded(folder: Path, w: dict[str, torch.Tensor]) -> Path:
    names = sorted(w)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for file, keys in shards.items():
        save_file({k: w[k] for k in keys}, folder / file)
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder / "model.safetensors.index.json"


def test_sharded_with_index_file_and_folder(tmp_path: Path) -> None:
    w = _weights()
    index = _sharded(tmp_path, w)
    convert(index, tmp_path / "from-index")
    _check(tmp_path / "from-index", w)
    convert(tmp_path, tmp_path / "from-folder", source_format="hf")
    _check(tmp_path / "from-folder", w)


def test_index_listing_a_missing_tensor_is_refused(tmp_path: Path) -> None:
    index = _sharded(tmp_path, _weights())
    data = json.loads(index.read_text())
    data["weight_map"]["extra.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ForeignCheckpointError, match="extra.weight"):
        convert(index, tmp_path / "out")


def test_missing_shard_is_named(tmp_path: Path) -> None:
    index = _sharded(tmp_path, _weights())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ForeignCheckpointError, match="model-00002-of-00002.safetensors"):
        convert(index, tmp_path / "out")


def test_corrupt_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ForeignCheckpointError, match="model.safetensors"):
        convert(tmp_path / "model.safetensors", tmp_path / "out")


def _with_header(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


@pytest.mark.parametrize(
    ("header", "data", "reason"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "starts at data byte 4, not 0"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "span 8 bytes, its F32 shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 9, "end at byte"),
        ({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, b"\0" * 8, "needs a dtype, a shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "needs a dtype, a shape"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "needs a dtype, a shape"),
        ({"a": [1, 2]}, b"", "needs a dtype, a shape"),
        ({"__metadata__": {"k": 1}}, b"", "must map strings to strings"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "starts at data byte 4, not 8",
        ),
    ],
    ids=["gap", "size", "trailing", "shape-type", "offsets-order", "negative", "entry-type", "metadata", "overlap"],
)
def test_the_byte_copy_path_refuses_what_safetensors_refuses(
    tmp_path: Path, header: dict, data: bytes, reason: str
) -> None:
    """``ucp convert`` checks a safetensors header itself (safe_open's check imports numpy): it refuses each
    file safetensors refuses, naming the file and why, and writes nothing."""
    from safetensors import safe_open

    path = tmp_path / "model.safetensors"
    path.write_bytes(_with_header(header, data))
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error types
        with safe_open(str(path), framework="numpy"):
            pass
    with pytest.raises(
        ForeignCheckpointError, match=f"model.safetensors' is not a readable safetensors file: .*{reason}"
    ):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_byte_copy_path_lists_tensors_as_safetensors_does(tmp_path: Path) -> None:
    """Out-of-order offsets, a metadata block and every dtype: the same names (sorted), values bit-exact."""
    from safetensors import safe_open

    from ucp.conversion.importers.hf import _laid_out_header

    weights = _weights()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    keys, start, header = _laid_out_header(tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert keys == list(f.keys())
    assert start == 8 + struct.unpack("<Q", (tmp_path / "model.safetensors").read_bytes()[:8])[0]
    convert(tmp_path / "model.safetensors", tmp_path / "out")
    _check(tmp_path / "out", weights)
