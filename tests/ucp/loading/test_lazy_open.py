"""``ucp.open(path)``: keys, metadata, whole tensors and slices read lazily; a slice reads only its
byte range, a whole tensor is CRC-checked, unknown names and bad indices are named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from ucp.store.storage import LocalStorage


@pytest.fixture()
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {
        "big": torch.randn(256, 1024),  # 1 MiB, rows of 4 KiB
        "cube": torch.arange(60.0).reshape(3, 4, 5).to(torch.bfloat16),
        "ints": torch.arange(10, dtype=torch.int64),
    }
    path = tmp_path / "c"
    ucp.save({"model": tensors, "step": 3}, path, metadata={"run": "lazy"})
    return path, tensors


@pytest.fixture()
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes every storage read_ranges call asked for, in order."""
    seen: list[int] = []
    original = LocalStorage.read_ranges

    def spy(self: LocalStorage, rel: str, ranges) -> None:  # noqa: ANN001 - an iterable of (offset, memoryview)
        ranges = list(ranges)
        seen.append(sum(m.nbytes for _, m in ranges))
        original(self, rel, ranges)

    monkeypatch.setattr(LocalStorage, "read_ranges", spy)
    return seen


def test_keys_metadata_and_whole_tensors(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = ckpt
    with ucp.open(path) as f:
        assert f.keys() == ["model.big", "model.cube", "model.ints"]
        assert f.metadata()["run"] == "lazy"
        for name, t in tensors.items():
            got = f.get_tensor(f"model.{name}")
            assert got.dtype == t.dtype and torch.equal(got, t)


def test_a_row_slice_reads_only_its_rows(ckpt: tuple[Path, dict[str, torch.Tensor]], bytes_read: list[int]) -> None:
    path, tensors = ckpt
    with ucp.open(path) as f:
        bytes_read.clear()
        s = f.get_slice("model.big")
        assert s.get_shape() == [256, 1024] and s.get_dtype() == "F32"
        got = s[100:102]
        assert torch.equal(got, tensors["big"][100:102])
        assert sum(bytes_read) == 2 * 4096  # two rows, not the 1 MiB tensor (nor its piece)
        bytes_read.clear()
        assert torch.equal(s[-1], tensors["big"][-1])
        assert sum(bytes_read) == 4096


def test_a_slice_of_a_truncated_file_reads_before_the_damage(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Bytes past the slice are never needed: zeroing the rest of the tensor leaves the slice intact."""
    path, tensors = ckpt
    manifest = ucp.read_manifest(path)
    (piece,) = manifest.tensors["model.big"].pieces
    data = path / piece.file
    raw = bytearray(data.read_bytes())
    start = piece.offset + 8 * 4096  # rows 8.. zeroed
    raw[start : piece.offset + piece.length] = bytes(piece.offset + piece.length - start)
    data.write_bytes(bytes(raw))
    with ucp.open(path) as f:
        assert torch.equal(f.get_slice("model.big")[0:8], tensors["big"][0:8])
        with pytest.raises(ucp.CorruptCheckpointError, match=r"model\.big"):
            f.get_tensor("model.big")  # a whole read checks the piece's CRC


@pytest.mark.parametrize(
    "index",
    [
        (slice(None), 2),
        (Ellipsis, slice(None, None, 2)),
        (-1, slice(1, None), 2),
        (slice(1, 3), Ellipsis),
        1,
        (slice(5, 1),),
    ],
)
def test_slices_match_tensor_indexing(ckpt: tuple[Path, dict[str, torch.Tensor]], index: Any) -> None:
    path, tensors = ckpt
    with ucp.open(path) as f:
        got = f.get_slice("model.cube")[index]
        want = tensors["cube"][index]
        assert got.shape == want.shape and torch.equal(got, want)


def test_unknown_names_and_bad_indices_are_named(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    f = ucp.open(path)
    with pytest.raises(ucp.LayoutMismatchError, match=r"tensor 'model\.bigg' is not in the checkpoint.*'model\.big'"):
        f.get_tensor("model.bigg")
    s = f.get_slice("model.cube")
    with pytest.raises(ucp.LayoutMismatchError, match=r"index 3 is out of range for dimension 0 of size 3"):
        s[3]
    with pytest.raises(ucp.LayoutMismatchError, match=r"too many indices \(4\)"):
        s[0, 0, 0, 0]
    with pytest.raises(ucp.LayoutMismatchError, match=r"slice steps must be positive"):
        s[::-1]
    f.close()
    with pytest.raises(ucp.CheckpointError, match="the reader is closed"):
        f.get_tensor("model.big")


def test_open_of_a_missing_path_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ucp.NotACheckpointError):
        ucp.open(tmp_path / "nope")
