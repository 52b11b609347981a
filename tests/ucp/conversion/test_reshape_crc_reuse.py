"""A reshape checksums each byte once: a piece copied whole keeps the CRC-32C its read checked.

The read verifies every source piece against its recorded CRC; a target piece holding exactly one
stored piece's elements has those bytes, so the writer records that CRC instead of hashing the bytes a
second time (``ucp.conversion.reshape.copied_crcs``). Only pieces cut from, or made of, several stored
pieces are hashed on the way out.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ucp_helpers import random_tensor, same_bytes

import ucp
import ucp.store.writer as writer
from reshard import plain_layout
from ucp.conversion.reshape import reshape
from ucp.errors import CheckpointError
from ucp.format.regions import same_elements


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes the file writer checksums, call by call (its module only: reads keep checking as before)."""
    calls: list[int] = []
    real = writer._crc32c.crc32c

    def counting(data: memoryview, value: int = 0) -> int:
        calls.append(memoryview(data).nbytes)
        return real(data, value)

    monkeypatch.setattr(writer, "_crc32c", SimpleNamespace(crc32c=counting))
    return calls


def _source(tmp_path: Path) -> Path:
    """Weights and one Adam moment per weight (the sections a plain DP/ZeRO layout tells apart)."""
    model = {
        "big": random_tensor(torch.float32, (1024, 700), seed=1),  # 2.7 MiB: the writer's thread path
        "small": random_tensor(torch.bfloat16, (33, 5), seed=2),  # inline path
        "odd": random_tensor(torch.float16, (777,), seed=3),
    }
    moments = {k: random_tensor(torch.float32, tuple(v.shape), seed=10 + i) for i, (k, v) in enumerate(model.items())}
    ucp.save({"model": model, "optimizer": {"exp_avg": moments}, "step": 3}, tmp_path / "src")
    return tmp_path / "src"


def test_consolidating_hashes_nothing_twice_and_keeps_the_stored_crcs(tmp_path: Path, hashed: list[int]) -> None:
    src = _source(tmp_path)
    hashed.clear()  # the save's own
    reshape(src, tmp_path / "one")
    assert sum(hashed) == 0, hashed  # every piece is a stored piece copied whole
    before, after = ucp.read_manifest(src), ucp.read_manifest(tmp_path / "one")
    for name, entry in before.tensors.items():
        assert [p.crc32c for p in after.tensors[name].pieces] == [p.crc32c for p in entry.pieces], name
    assert ucp.verify(tmp_path / "one").problems == []
    assert same_bytes(ucp.load(tmp_path / "one")["model"]["big"], ucp.load(src)["model"]["big"])


def test_only_pieces_cut_from_stored_ones_are_hashed(tmp_path: Path, hashed: list[int]) -> None:
    src = _source(tmp_path)
    hashed.clear()  # the save's own
    # ZeRO-1 over 4 ranks: the weights replicated (rank 0 copies them whole), the moments partitioned
    reshape(src, tmp_path / "z1", layout=plain_layout(4, 1))
    m, stored = ucp.read_manifest(tmp_path / "z1"), ucp.read_manifest(src)
    pieces = [(name, p) for name, e in m.tensors.items() for p in e.pieces]
    whole = [same_elements(p.region(), stored.tensors[n].pieces[0].region(), m.tensors[n].shape) for n, p in pieces]
    cut = sum(p.length for (_, p), w in zip(pieces, whole) if not w)
    assert 0 < sum(hashed) == cut < sum(p.length for _, p in pieces), (hashed, cut)
    assert ucp.verify(tmp_path / "z1").problems == []
    reshape(tmp_path / "z1", tmp_path / "back")
    want, got = ucp.load(src), ucp.load(tmp_path / "back")
    for section in ("model", "optimizer"):
        for name, tensor in (want[section] if section == "model" else want[section]["exp_avg"]).items():
            back = got[section][name] if section == "model" else got[section]["exp_avg"][name]
            assert same_bytes(back, tensor), (section, name)


def test_a_damaged_stored_piece_still_fails_the_reshape_it_is_copied_by(tmp_path: Path) -> None:
    """The CRC a copied piece keeps is the stored one: should the bytes not match it, the read's check
    fails the reshape (naming the tensor) and nothing is committed with a CRC its bytes do not have."""
    src = _source(tmp_path)
    m = ucp.read_manifest(src)
    piece = m.tensors["model.big"].pieces[0]
    with open(src / piece.file, "r+b") as f:
        f.seek(piece.offset + piece.length // 2)
        byte = f.read(1)
        f.seek(piece.offset + piece.length // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CheckpointError, match="model.big"):
        reshape(src, tmp_path / "one")
    assert not (tmp_path / "one").exists()
