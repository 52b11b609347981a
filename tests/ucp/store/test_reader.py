"""Damaged checkpoints: every way the data can disagree with the manifest gets a clear CheckpointError."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from ucp_helpers import random_tensor

import ucp

FILE = "rank-00000.safetensors"


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    sd = {
        "a": random_tensor(torch.float32, (64, 64), seed=1),
        "b": random_tensor(torch.int16, (100,), seed=2),
        "c": {"d": random_tensor(torch.bfloat16, (7, 3), seed=3)},
    }
    ucp.save(sd, tmp_path / "ck")
    return tmp_path / "ck"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def rewrite_header(path: Path, edit) -> None:
    """Edit the safetensors header JSON in place, keeping its padded length."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    assert len(text) <= n
    data[8 : 8 + n] = text + b" " * (n - len(text))
    path.write_bytes(bytes(data))


def all_loads(path: Path):
    """Every reader: whole load, load into a structure (partial path), verify."""
    yield lambda: ucp.load(path)
    yield lambda: ucp.load(
        path,
        into={
            "a": torch.empty(64, 64),
            "b": torch.empty(100, dtype=torch.int16),
            "c": {"d": torch.empty(7, 3, dtype=torch.bfloat16)},
        },
    )
    yield lambda: ucp.load(
        path,
        into={
            "a": ucp.ShardedTensor(torch.empty(8, 64), (64, 64), (8, 0)),
            "b": torch.empty(100),
            "c": {"d": torch.empty(7, 3)},
        },
    )


def test_flipped_byte_names_tensor_file_offset(ck):
    m = ucp.read_manifest(ck)
    p = m.tensors["c.d"].pieces[0]
    flip_byte(ck / FILE, p.offset + 5)
    for fn in all_loads(ck):
        with pytest.raises(ucp.CorruptCheckpointError) as info:
            fn()
        msg = str(info.value)
        assert "tensor 'c.d'" in msg and FILE in msg and f"offset {p.offset}" in msg and "CRC" in msg
    report = ucp.verify(ck)
    assert not report.ok and len(report.problems) == 1
    assert report.problems[0].kind == "CorruptCheckpointError" and "'c.d'" in report.problems[0].message
    # a load that does not verify nor touch the damaged piece still works
    out = ucp.load(ck, into={"a": torch.empty(64, 64)})
    assert out["a"].shape == (64, 64)


def test_flipped_byte_in_partial_read_without_verify_is_not_detected_but_elsewhere_is(ck):
    m = ucp.read_manifest(ck)
    p = m.tensors["a"].pieces[0]
    flip_byte(ck / FILE, p.offset + 4 * 64 * 60)  # row 60
    into = {"a": ucp.ShardedTensor(torch.empty(8, 64), (64, 64), (0, 0))}
    ucp.load(ck, into=into, verify=False)  # rows 0..7 only: fine
    with pytest.raises(ucp.CorruptCheckpointError, match="'a'"):
        ucp.load(ck, into=into)  # verifying reads the whole piece


def test_truncated_file(ck):
    size = os.path.getsize(ck / FILE)
    os.truncate(ck / FILE, size - 10)
    for fn in all_loads(ck):
        with pytest.raises(ucp.CorruptCheckpointError, match=rf"{FILE}.*truncated.*{size - 10} bytes.*{size}"):
            fn()
    assert "truncated" in ucp.verify(ck).problems[0].message


def test_missing_data_file(ck):
    os.unlink(ck / FILE)
    for fn in all_loads(ck):
        with pytest.raises(ucp.MissingDataError, match=FILE):
            fn()
    assert ucp.verify(ck).problems[0].kind == "MissingDataError"


def test_missing_manifest(ck, tmp_path):
    os.unlink(ck / "manifest.json")
    with pytest.raises(ucp.NotACheckpointError, match="no manifest.json"):
        ucp.load(ck)
    with pytest.raises(ucp.NotACheckpointError):
        ucp.load(tmp_path / "nothing-here")
    report = ucp.verify(ck)
    assert not report.ok and report.problems[0].kind == "NotACheckpointError"


def test_invalid_manifest_json(ck):
    (ck / "manifest.json").write_text('{"format_version": 1, "tensors": ')
    with pytest.raises(ucp.ManifestError, match="not valid JSON"):
        ucp.load(ck)
    assert ucp.verify(ck).problems[0].kind == "ManifestError"


def test_unknown_format_version_on_disk(ck):
    raw = json.loads((ck / "manifest.json").read_text())
    raw["format_version"] = 3
    (ck / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ucp.UnsupportedFormatError, match="format_version 3"):
        ucp.load(ck)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h["a"].update(dtype="I32"), "'a'.*header says"),
        (lambda h: h["b"].update(shape=[50, 2]), "'b'.*header says"),
        (lambda h: h["a"].update(data_offsets=[0, 16]), "'a'.*header says"),
        (lambda h: h.update(extra={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}), "header only: \\['extra'\\]"),
        (lambda h: h.pop("c.d"), "manifest only: \\['c.d'\\]"),
    ],
)
def test_header_inconsistent_with_manifest(ck, edit, match):
    rewrite_header(ck / FILE, edit)
    for fn in all_loads(ck):
        with pytest.raises(ucp.CorruptCheckpointError, match=match):
            fn()
    assert not ucp.verify(ck).ok


def test_garbage_header_length(ck):
    with open(ck / FILE, "r+b") as f:
        f.write(struct.pack("<Q", 2**60))
    for fn in all_loads(ck):
        with pytest.raises(ucp.CorruptCheckpointError, match="header"):
            fn()


def test_header_not_json(ck):
    with open(ck / FILE, "r+b") as f:
        f.seek(8)
        f.write(b"\x00\x01garbage")
    for fn in all_loads(ck):
        with pytest.raises(ucp.CorruptCheckpointError, match="not valid JSON"):
            fn()


def test_verify_reports_counts(ck):
    r = ucp.verify(ck)
    assert r.ok and r.files_checked == 1 and r.tensors == 3 and r.pieces_checked == 3
    assert r.bytes_checked == os.path.getsize(ck / FILE)


def test_dtype_mismatch_between_manifest_length_and_shape(ck):
    raw = json.loads((ck / "manifest.json").read_text())
    raw["tensors"]["b"]["dtype"] = "I32"  # 100 x 4 bytes != stored length 200
    (ck / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ucp.ManifestError, match="'b'.*length 200"):
        ucp.load(ck)


def test_errors_and_problems_carry_their_location(ck):
    calls = []
    assert ucp.verify(ck, progress=lambda done, total: calls.append((done, total))).ok
    size = os.path.getsize(ck / FILE)
    assert calls and calls[-1] == (size, size)
    m = ucp.read_manifest(ck)
    p = m.tensors["b"].pieces[0]
    flip_byte(ck / FILE, p.offset + 1)
    with pytest.raises(ucp.CorruptCheckpointError) as info:
        ucp.load(ck)
    assert (info.value.tensor, info.value.file, info.value.offset) == ("b", FILE, p.offset)
    (problem,) = ucp.verify(ck).problems
    assert (problem.tensor, problem.file, problem.offset) == ("b", FILE, p.offset)
