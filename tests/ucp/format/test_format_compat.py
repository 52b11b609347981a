"""Checkpoints written by format version 1 (no manifest checksum) still load, bit-exact, and verify.

data/v1_checkpoint was written by commit 0285947 (the last version-1 writer) with::

    ucp.save(_expected(), out, step=100, metadata={"note": "written by format version 1 (commit 0285947)"})
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ucp
from ucp.format.manifest import CHECKSUM_FIELD, parse_manifest

V1 = Path(__file__).parent / "data" / "v1_checkpoint"


def _expected() -> dict:
    return {
        "model": {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
            "b": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        },
        "optimizer": {
            "step": 100,
            "lr": 3e-4,
            "betas": (0.9, 0.999),
            "state": {0: {"count": torch.tensor([7, -8, 9], dtype=torch.int64)}},
        },
        "epoch": 3,
        "name": "v1 fixture",
        "ratio": float("inf"),
    }


def _assert_same(got: object, want: object, path: str = "") -> None:
    assert type(got) is type(want), path
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.view(torch.uint8).tolist() == want.view(torch.uint8).tolist(), path
    elif isinstance(want, (dict, list, tuple)):
        keys = list(want) if isinstance(want, dict) else range(len(want))
        assert (list(got) if isinstance(got, dict) else range(len(got))) == keys, path  # type: ignore[arg-type]
        for k in keys:
            _assert_same(got[k], want[k], f"{path}[{k!r}]")  # type: ignore[index]
    else:
        assert got == want, path


def test_v1_fixture_is_version_1_without_a_checksum() -> None:
    raw = json.loads((V1 / "manifest.json").read_bytes())
    assert raw["format_version"] == 1 and CHECKSUM_FIELD not in raw
    assert ucp.FORMAT_VERSION == 2  # what this reader writes: the fixture is an older version


def test_v1_checkpoint_loads_bit_exact() -> None:
    manifest = ucp.read_manifest(V1)
    assert manifest.format_version == 1 and manifest.step == 100
    assert manifest.metadata == {"note": "written by format version 1 (commit 0285947)"}
    _assert_same(ucp.load(V1), _expected())


def test_v1_checkpoint_verifies() -> None:
    report = ucp.verify(V1)
    assert report.ok, report.problems
    assert report.format_version == 1 and report.files_checked == 1 and report.pieces_checked == 3


def test_v1_manifest_is_still_checked(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(V1, ck)
    raw = json.loads((ck / "manifest.json").read_bytes())
    raw["tensors"]["model.w"]["pieces"][0]["length"] = 44
    (ck / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ucp.ManifestError, match="manifest.json: .*model.w.*length 44"):
        ucp.load(ck)
    shutil.copy(V1 / "rank-00000.safetensors", ck / "rank-00000.safetensors")
    with open(ck / "rank-00000.safetensors", "r+b") as f:  # a flipped data bit: the piece CRCs still guard v1
        f.seek(4120)
        f.write(bytes([f.read(1)[0] ^ 1]))
    (ck / "manifest.json").write_bytes((V1 / "manifest.json").read_bytes())
    with pytest.raises(ucp.CorruptCheckpointError, match="model.w"):
        ucp.load(ck)


def test_v1_checkpoint_saved_again_is_version_2(tmp_path: Path) -> None:
    ucp.save(ucp.load(V1), tmp_path / "again", step=100)
    data = (tmp_path / "again" / "manifest.json").read_bytes()
    assert json.loads(data)["format_version"] == 2 and CHECKSUM_FIELD in json.loads(data)
    _assert_same(ucp.load(tmp_path / "again"), _expected())
    old, new = parse_manifest((V1 / "manifest.json").read_bytes()), parse_manifest(data)
    assert old.tensors == new.tensors and old.state == new.state
