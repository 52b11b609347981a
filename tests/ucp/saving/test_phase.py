"""Large pieces are placed in phase with their tensor's memory so aio can write them without copying."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ucp
from ucp.saving.plan import DATA_ALIGNMENT, DIRECT_MIN_BYTES


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_large_pieces_start_in_phase_with_their_memory(tmp_path: Path) -> None:
    big = torch.randn(DIRECT_MIN_BYTES // 4 + 1000)
    odd = torch.randn(DIRECT_MIN_BYTES // 4 + 77)[5:]  # a view: its address is not page aligned
    small = torch.arange(7, dtype=torch.int16)
    sd = {"big": big, "odd": odd, "small": small}
    manifest = ucp.save(sd, tmp_path / "c")
    for name, t in (("big", big), ("odd", odd)):
        (piece,) = manifest.tensors[name].pieces
        assert piece.offset % DATA_ALIGNMENT == t.data_ptr() % DATA_ALIGNMENT
    data_file = tmp_path / "c" / "rank-00000.safetensors"
    header = _header(data_file)
    assert any(k.startswith("__pad__.") for k in header)
    with safe_open(str(data_file), "pt") as f:  # padding entries are ordinary U8 tensors to safetensors
        for name, t in sd.items():
            assert torch.equal(f.get_tensor(name), t)
    out = ucp.load(tmp_path / "c")
    assert set(out) == set(sd) and all(torch.equal(out[k], v) for k, v in sd.items())
    assert ucp.verify(tmp_path / "c").ok


def test_state_names_cannot_take_the_padding_prefix(tmp_path: Path) -> None:
    sd = {"__pad__": {"0": torch.ones(3)}}  # would be named "__pad__.0"
    manifest = ucp.save(sd, tmp_path / "c")
    assert not any(n.startswith("__pad__.") for n in manifest.tensors)
    assert torch.equal(ucp.load(tmp_path / "c")["__pad__"]["0"], torch.ones(3))


def test_a_malformed_padding_entry_is_rejected(tmp_path: Path) -> None:
    big = torch.randn(DIRECT_MIN_BYTES // 4 + 1000)[3:]
    ucp.save({"big": big}, tmp_path / "c")
    data_file = tmp_path / "c" / "rank-00000.safetensors"
    raw = bytearray(data_file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n].decode()
    pad = next(k for k in json.loads(text) if k.startswith("__pad__."))
    raw[8 : 8 + n] = text.replace(f'"{pad}":{{"dtype":"U8"', f'"{pad}":{{"dtype":"I8"').encode()
    data_file.write_bytes(bytes(raw))
    with pytest.raises(ucp.CheckpointError, match="padding entry"):
        ucp.load(tmp_path / "c")
