"""A data file's safetensors header: UCP refuses what ``safetensors.safe_open`` refuses (a
``__metadata__`` that is not a map of strings to strings), and never writes such a header."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ucp
from ucp.conversion.reshape import reshape
from ucp.saving.async_save import async_save

RANK0 = "rank-00000.safetensors"


def _save(path: Path) -> Path:
    ucp.save({"model": {"w": torch.arange(8.0), "b": torch.ones(2, dtype=torch.int32)}}, path)
    return path


def _set_metadata(file: Path, metadata: object) -> None:
    """Rewrite the header's ``__metadata__`` in place, keeping its length (spaces pad it, as safetensors allows)."""
    data = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    assert len(text) <= n
    data[8 : 8 + n] = text.ljust(n, b" ")
    file.write_bytes(bytes(data))


def _safetensors_refuses(file: Path) -> bool:
    try:
        with safe_open(str(file), "pt") as f:
            f.metadata()
    except Exception:  # safetensors raises its own SafetensorError
        return True
    return False


@pytest.mark.parametrize(
    "metadata",
    [{"format": "ucp", "rank": 0}, {"format": None}, {"nested": {"a": "b"}}, ["format", "ucp"], "ucp", 7],
    ids=["int-value", "null-value", "map-value", "list", "string", "number"],
)
def test_metadata_that_safetensors_refuses_is_refused(tmp_path: Path, metadata: object) -> None:
    ck = _save(tmp_path / "ck")
    _set_metadata(ck / RANK0, metadata)
    assert _safetensors_refuses(ck / RANK0)
    with pytest.raises(ucp.CorruptCheckpointError, match=f"{RANK0}.*'__metadata__' must map strings to strings"):
        ucp.load(ck)
    with pytest.raises(ucp.CorruptCheckpointError, match=RANK0):
        ucp.load(ck, verify=False)
    report = ucp.verify(ck)
    assert not report.ok and report.problems[0].file == RANK0
    assert "__metadata__" in report.problems[0].message


@pytest.mark.parametrize(
    "metadata", [None, {}, {"format": "ucp", "extra": "any string"}], ids=["null", "empty", "more"]
)
def test_metadata_that_safetensors_accepts_is_accepted(tmp_path: Path, metadata: object) -> None:
    ck = _save(tmp_path / "ck")
    _set_metadata(ck / RANK0, metadata)
    assert not _safetensors_refuses(ck / RANK0)
    assert torch.equal(ucp.load(ck)["model"]["w"], torch.arange(8.0))
    assert ucp.verify(ck).ok


def test_every_writer_writes_string_to_string_metadata(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(8.0), "b": torch.ones(2, dtype=torch.int32)}, "step": 3}
    ucp.save(state, tmp_path / "sync", step=3, metadata={"run": {"nested": [1, 2]}})
    async_save(state, tmp_path / "async", step=3).result()
    reshape(tmp_path / "sync", tmp_path / "reshaped")
    files = sorted(tmp_path.glob("*/*.safetensors"))
    assert {f.parent.name for f in files} == {"sync", "async", "reshaped"}
    for file in files:
        with safe_open(str(file), "pt") as f:
            metadata = f.metadata()
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()), (file, metadata)
        assert metadata["format"] == "ucp" and metadata["ucp_format_version"] == str(ucp.FORMAT_VERSION)
