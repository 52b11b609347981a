"""Reading manifest.json: the schema, every semantic check, and the error each bad input gets."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import ucp
from ucp.format.manifest import parse_manifest, seal


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> dict:
    """A valid manifest (as a JSON dict) with box, flat, 0-d and empty tensors and two files."""
    d = tmp_path_factory.mktemp("m")
    sd = {"w": torch.ones(4, 6), "s": torch.tensor(1.0), "e": torch.empty(0, 3), "o": {0: {"x": torch.ones(2)}}, "k": 1}
    ucp.save(sd, d / "ck")
    raw = json.loads((d / "ck" / "manifest.json").read_text())
    # turn "w" into two pieces in two files: a box of rows 0-1 and a flat range for rows 2-3
    w = raw["tensors"]["w"]
    p = w["pieces"][0]
    raw["files"]["rank-00001.safetensors"] = {"rank": 0, "size": 4096 + 48}
    w["pieces"] = [
        {**p, "length": 48, "box": {"offsets": [0, 0], "shape": [2, 6]}},
        {
            "file": "rank-00001.safetensors",
            "offset": 4096,
            "length": 48,
            "flat": {"start": 12, "stop": 24},
            "crc32c": 7,
        },
    ]
    raw = json.loads(seal(raw))  # edited on purpose: sealed again
    parse_manifest(json.dumps(raw))
    return raw


def parse(raw) -> ucp.Manifest:
    return parse_manifest(json.dumps(raw) if not isinstance(raw, (str, bytes)) else raw)


def mutate(valid, fn):
    raw = copy.deepcopy(valid)
    fn(raw)
    return raw


def test_valid_manifest_round_trips(valid):
    m = parse(valid)
    again = parse_manifest(m.to_json())
    assert again == m
    assert m.tensors["w"].pieces[1].flat.start == 12


@pytest.mark.parametrize(
    "data", [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"format_version": 1', "[" * 5000 + "]" * 5000]
)
def test_invalid_json(data):
    with pytest.raises(ucp.ManifestError):
        parse_manifest(data)


@pytest.mark.parametrize("version", [0, 3, 99, -1])
def test_unknown_format_version(valid, version):
    with pytest.raises(ucp.UnsupportedFormatError, match=f"format_version {version}"):
        parse(mutate(valid, lambda r: r.update(format_version=version)))


@pytest.mark.parametrize("version", ["1", 1.0, True, None])
def test_format_version_must_be_an_int(valid, version):
    with pytest.raises(ucp.ManifestError, match="format_version"):
        parse(mutate(valid, lambda r: r.update(format_version=version)))


def test_version_checked_before_schema():
    with pytest.raises(ucp.UnsupportedFormatError):
        parse_manifest(json.dumps({"format_version": 3, "something": "new"}))


def _set_piece(i: int, **kw):
    def fn(r):
        r["tensors"]["w"]["pieces"][i].update(kw)

    return fn


BAD = {
    "unknown field": (lambda r: r.update(extra=1), "schema"),
    "missing field": (lambda r: r.pop("tensors"), "schema"),
    "string for int": (_set_piece(0, offset="4096"), "schema"),
    "float for int": (_set_piece(0, offset=4096.0), "schema"),
    "bool for int": (_set_piece(0, length=True), "schema"),
    "dotdot file": (_set_piece(0, file="../etc/passwd"), "file"),
    "absolute file": (lambda r: r["files"].update({"/etc/passwd": {"rank": 0, "size": 10}}), "plain file name"),
    "hidden file": (lambda r: r["files"].update({".x": {"rank": 0, "size": 10}}), "plain file name"),
    "backslash file": (lambda r: r["files"].update({"a\\b": {"rank": 0, "size": 10}}), "plain file name"),
    "manifest as file": (lambda r: r["files"].update({"manifest.json": {"rank": 0, "size": 10}}), "plain file name"),
    "unlisted file": (_set_piece(0, file="rank-00009.safetensors"), "does not list"),
    "unknown dtype": (lambda r: r["tensors"]["w"].update(dtype="F128"), "unknown dtype 'F128'"),
    "negative dim": (lambda r: r["tensors"]["w"].update(shape=[-4, -6]), "shape"),
    "huge shape": (lambda r: r["tensors"]["w"].update(shape=[2**40, 2**40]), "absurd"),
    "too many dims": (lambda r: r["tensors"]["w"].update(shape=[1] * 65), "dims"),
    "negative offset": (_set_piece(0, offset=-1), "out of range"),
    "offset past file": (_set_piece(0, offset=10**6), "past the file"),
    "overflowing offset": (_set_piece(0, offset=2**64), "out of range"),
    "length mismatch": (_set_piece(0, length=47), "length 47"),
    "crc out of range": (_set_piece(0, crc32c=2**32), "crc32c"),
    "both box and flat": (_set_piece(0, flat={"start": 0, "stop": 12}), "exactly one"),
    "neither box nor flat": (lambda r: r["tensors"]["w"]["pieces"][0].pop("box"), "exactly one"),
    "box rank": (_set_piece(0, box={"offsets": [0], "shape": [12]}), "rank"),
    "box outside": (_set_piece(0, box={"offsets": [3, 0], "shape": [2, 6]}), "outside"),
    "box negative": (_set_piece(0, box={"offsets": [-1, 0], "shape": [2, 6]}), "out of range"),
    "flat outside": (_set_piece(1, flat={"start": 12, "stop": 36}, length=96), "outside"),
    "flat reversed": (_set_piece(1, flat={"start": 24, "stop": 12}), "outside"),
    "pieces overlap": (_set_piece(1, flat={"start": 6, "stop": 18}), "overlap"),
    "pieces leave a gap": (_set_piece(1, flat={"start": 12, "stop": 18}, length=24), "cover 18 of 24"),
    "no pieces": (lambda r: r["tensors"]["w"].update(pieces=[]), "cover 0 of 24"),
    "duplicate piece": (lambda r: r["tensors"]["w"]["pieces"].append(r["tensors"]["w"]["pieces"][0]), "overlap"),
    "byte overlap in file": (lambda r: r["tensors"]["s"]["pieces"][0].update(offset=4096), "overlaps the bytes"),
    "file size bad": (lambda r: r["files"]["rank-00001.safetensors"].update(size=-5), "out of range"),
    "file rank bad": (lambda r: r["files"]["rank-00001.safetensors"].update(rank=3), "world_size"),
    "world size zero": (lambda r: r["topology"].update(world_size=0), "world_size"),
    "mesh mismatch": (lambda r: r["topology"].update(mesh={"dp": 2}), "mesh"),
    "dangling ref": (lambda r: r["state"]["dict"].update(k={"tensor": "nope"}), "'nope'"),
    "double ref": (lambda r: r["state"]["dict"].update(k={"tensor": "w"}), "more than once"),
    "unreferenced": (lambda r: r["state"]["dict"].pop("w"), "not referenced"),
    "bad tag": (lambda r: r["state"]["dict"].update(k={"pickle": "x"}), "state node"),
    "two tags": (lambda r: r["state"]["dict"].update(k={"tuple": [], "dict": {}}), "state node"),
    "bad float": (lambda r: r["state"]["dict"].update(k={"float": "1e999"}), "'float'"),
    "bad items": (lambda r: r["state"]["dict"].update(k={"items": [[1]]}), "pair"),
    "bool key": (lambda r: r["state"]["dict"].update(k={"items": [[True, 1]]}), "key"),
    "dup key": (lambda r: r["state"]["dict"].update(k={"items": [[1, 1], [1, 2]]}), "duplicate"),
    "root not dict": (lambda r: r.update(state=[1]), "root"),
    "reserved name": (lambda r: r["tensors"].update({"__metadata__": r["tensors"].pop("s")}), "reserved"),
    "bad created": (lambda r: r.update(created="yesterday"), "schema"),
    "metadata not object": (lambda r: r.update(metadata=[1]), "schema"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_manifest_is_refused(valid, case):
    fn, match = BAD[case]
    with pytest.raises(ucp.ManifestError, match=match):
        parse(mutate(valid, fn))


def test_errors_name_tensor_file_and_offset(valid):
    with pytest.raises(ucp.ManifestError) as info:
        parse(mutate(valid, _set_piece(0, offset=10**6)))
    msg = str(info.value)
    assert "tensor 'w'" in msg and "rank-00000.safetensors" in msg and "offset 1000000" in msg
    assert isinstance(info.value, ValueError)
