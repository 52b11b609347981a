"""manifest.json protects itself: a CRC-32C of its canonical bytes (format version 2), a size cap
checked before the file is read, and caps on what it may declare."""

from __future__ import annotations

import asyncio
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import crc32c
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import ucp
import ucp.format.manifest as manifest_mod
from ucp.cli.main import app
from ucp.conversion.importers import convert
from ucp.conversion.reshape import reshape
from ucp.format.manifest import CHECKSUM_FIELD, MAX_MANIFEST_BYTES, parse_manifest, seal
from ucp.manager import check_complete, looks_complete
from ucp.saving.async_save import aload, async_save


def _counting(read_small: Callable[..., bytes], reads: list[str]) -> Callable[..., bytes]:
    """``read_small`` noting in ``reads`` each path it reads."""

    def spy(self: Any, rel: str) -> bytes:
        reads.append(rel)
        return read_small(self, rel)

    return spy


def _state() -> dict:
    return {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
        "optimizer": {"step": 100, "lr": 0.001, "betas": (0.9, 0.999)},
        "name": "run",
    }


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    ucp.save(_state(), tmp_path / "ck", step=100)
    return tmp_path / "ck"


def test_every_save_path_writes_a_sealed_version_2_manifest(tmp_path: Path) -> None:
    ucp.save(_state(), tmp_path / "sync")
    async_save(_state(), tmp_path / "async").result()
    reshape(tmp_path / "sync", tmp_path / "reshaped")
    save_file({"w": torch.ones(3, 2)}, str(tmp_path / "model.safetensors"))
    convert(tmp_path / "model.safetensors", tmp_path / "imported")
    for name in ("sync", "async", "reshaped", "imported"):
        data = (tmp_path / name / "manifest.json").read_bytes()
        raw = json.loads(data)
        assert raw["format_version"] == ucp.FORMAT_VERSION == 2
        # the seal is the last member; the file without it is exactly the bytes it covers
        member = f',\n "{CHECKSUM_FIELD}": {raw[CHECKSUM_FIELD]}'.encode()
        assert data.endswith(member + b"\n}\n")
        assert raw[CHECKSUM_FIELD] == crc32c.crc32c(data.replace(member, b""))
        assert ucp.verify(tmp_path / name).ok


def test_every_single_bit_flip_is_refused_naming_the_manifest_or_changes_nothing(ck: Path) -> None:
    data = (ck / "manifest.json").read_bytes()
    source = str(ck / "manifest.json")
    original = parse_manifest(data, source=source)
    refused = 0
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            try:
                m = parse_manifest(bytes(flipped), source=source)
            except ucp.ManifestError as exc:
                assert source in str(exc), str(exc)
                refused += 1
                continue
            assert m == original, f"byte {i} bit {bit}: {bytes(flipped[max(0, i - 20) : i + 20])!r} loads changed"
    assert refused > 0.99 * 8 * len(data)


def test_flipped_step_is_refused_by_load_verify_and_the_cli(ck: Path) -> None:
    path = ck / "manifest.json"
    data = path.read_bytes()
    assert data.count(b'"step": 100,') == 2  # the manifest's step and the optimizer's, in the state tree
    for at in (data.index(b'"step": 100,'), data.rindex(b'"step": 100,')):
        flipped = bytearray(data)
        flipped[at + len(b'"step": ')] ^= 0x02  # "1" -> "3": step 300, still valid JSON and schema
        path.write_bytes(bytes(flipped))
        with pytest.raises(ucp.ManifestError, match="manifest.json: checksum mismatch"):
            ucp.load(ck)
        report = ucp.verify(ck)
        assert not report.ok and report.problems[0].kind == "ManifestError"
        assert "manifest.json" in report.problems[0].message and "checksum" in report.problems[0].message
        result = CliRunner().invoke(app, ["verify", str(ck)])
        assert result.exit_code != 0 and "checksum mismatch" in result.output
    path.write_bytes(data)
    assert ucp.load(ck)["optimizer"]["step"] == 100


def test_whitespace_and_escapes_are_outside_the_canonical_form(ck: Path) -> None:
    path = ck / "manifest.json"
    raw = json.loads(path.read_bytes())
    path.write_text(json.dumps(raw, indent=3, ensure_ascii=True))  # reformatted: same content
    assert ucp.verify(ck).ok
    assert torch.equal(ucp.load(ck)["model"]["w"], _state()["model"]["w"])


def test_edited_content_is_refused_until_sealed_again(ck: Path) -> None:
    path = ck / "manifest.json"
    raw = json.loads(path.read_bytes())
    raw["metadata"]["note"] = "added by hand"
    path.write_text(json.dumps(raw))
    with pytest.raises(ucp.ManifestError, match="checksum mismatch.*edited by hand"):
        ucp.read_manifest(ck)
    path.write_bytes(seal(raw))
    assert ucp.read_manifest(ck).metadata["note"] == "added by hand"


def test_the_seal_must_match_the_version(ck: Path) -> None:
    raw = json.loads((ck / "manifest.json").read_bytes())
    del raw[CHECKSUM_FIELD]
    with pytest.raises(ucp.ManifestError, match=f"format_version 2 lacks '{CHECKSUM_FIELD}'"):
        parse_manifest(json.dumps(raw))
    raw[CHECKSUM_FIELD], raw["format_version"] = 5, 1
    with pytest.raises(ucp.ManifestError, match="version 1 lacks"):
        parse_manifest(json.dumps(raw))
    raw[CHECKSUM_FIELD], raw["format_version"] = "5", 2
    with pytest.raises(ucp.ManifestError, match=CHECKSUM_FIELD):
        parse_manifest(json.dumps(raw))


def _oversized(ck: Path) -> int:
    """Make manifest.json a sparse file just over the cap: reading it whole would take 256 MiB."""
    size = MAX_MANIFEST_BYTES + 1
    with open(ck / "manifest.json", "r+b") as f:
        f.truncate(size)
    return size


def test_oversized_manifest_is_refused_before_it_is_read(ck: Path) -> None:
    size = _oversized(ck)
    tracemalloc.start()
    try:
        with pytest.raises(ucp.ManifestError) as info:
            ucp.load(ck)
        report = ucp.verify(ck)
        status, _, detail = check_complete(str(ck))  # what `ucp ls` shows
        complete = looks_complete(str(ck))
        with pytest.raises(ucp.ManifestError) as async_info:
            asyncio.run(aload(ck))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for message in (str(info.value), report.problems[0].message, str(async_info.value), str(detail)):
        assert "manifest.json" in message and f"{size} bytes" in message and "limit" in message
    assert not report.ok and status == "corrupt" and not complete
    assert peak < 32 << 20, f"peak {peak >> 20} MiB: the oversized manifest was read"


def test_declared_counts_are_capped(ck: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = (ck / "manifest.json").read_bytes()
    monkeypatch.setattr(manifest_mod, "MAX_TENSORS", 0)
    with pytest.raises(ucp.ManifestError, match="lists 1 tensors, over the limit of 0"):
        parse_manifest(data)
    monkeypatch.setattr(manifest_mod, "MAX_TENSORS", 1 << 20)
    monkeypatch.setattr(manifest_mod, "MAX_PIECES", 0)
    with pytest.raises(ucp.ManifestError, match="lists 1 pieces, over the limit of 0"):
        parse_manifest(data)


def test_manifest_size_cap_is_a_module_constant() -> None:
    assert MAX_MANIFEST_BYTES == 256 << 20


def test_oversized_remote_manifest_is_refused_before_it_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    import ucp.store.reader as reader_mod
    from ucp.store.storage import Storage

    url = f"memory://ucp-test-manifest-cap-{os.getpid()}/ck"
    fs = fsspec.filesystem("memory")
    try:
        ucp.save(_state(), url)
        size = fs.size(f"{url}/manifest.json")
        monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", size - 1)  # the limit the message states
        monkeypatch.setattr(reader_mod, "MAX_MANIFEST_BYTES", size - 1)  # the limit the reader applies
        reads: list[str] = []
        for cls in {type(s) for s in Storage.__subclasses__()} | set(Storage.__subclasses__()):
            if "read_small" in vars(cls):
                original = vars(cls)["read_small"]
                monkeypatch.setattr(cls, "read_small", _counting(original, reads))
        with pytest.raises(ucp.ManifestError, match=rf"manifest.json: {size} bytes, over the {size - 1} byte limit"):
            ucp.load(url)
        assert not [r for r in reads if r.endswith("manifest.json")]
        monkeypatch.setattr(reader_mod, "MAX_MANIFEST_BYTES", size)  # at the limit: read (the spy sees it)
        monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", size)
        assert ucp.load(url)["optimizer"]["step"] == 100
        assert [r for r in reads if r.endswith("manifest.json")]
    finally:
        if fs.exists(url):
            fs.rm(url, recursive=True)


def test_a_manifest_in_memory_is_its_content_not_its_seal(tmp_path: Path) -> None:
    saved = ucp.save(_state(), tmp_path / "ck", step=100)
    data = (tmp_path / "ck" / "manifest.json").read_bytes()
    read, plain = parse_manifest(data), ucp.Manifest.model_validate_json(data)  # the latter: no checks at all
    assert saved == read == plain and read.manifest_crc32c is None and plain.manifest_crc32c is None
    assert read.to_json() == plain.to_json() == saved.to_json() == data
    assert CHECKSUM_FIELD not in read.model_dump() and CHECKSUM_FIELD not in read.model_fields_set
