"""The snapshot's copy checksums what it copies (kernels.copy_crc32c): the CRCs it hands the writer are
those of the bytes written, for every snapshot mode, and a checkpoint saved that way verifies, loads
bit-exactly and still has a damaged byte found."""

from __future__ import annotations

import sys

import crc32c
import pytest
import torch
from async_save_worker import COW
from ucp_helpers import assert_same_state, random_tensor

import ucp
from ucp.format.manifest import Manifest
from ucp.saving.async_save import AsyncSaver
from ucp.saving.background import execute as _execute
from ucp.store import writer as _writer

# (AsyncSaver mode, snapshot): every way an asynchronous save captures the state
SAVERS = [("thread", "sync"), ("thread", "background"), ("thread", "none"), ("process", "sync")]
SAVERS += [("process", "background")] + ([("thread", "cow")] if COW else [])
NOT_IN_PLACE = {
    "model.t",
    "model.c",
}  # a transposed view and a conjugate view: copied by torch, checksummed by the writer


def state() -> dict:
    """Contiguous pieces of several dtypes and odd sizes (one spanning several copy chunks), an empty and a
    0-d tensor, and two pieces whose bytes are not the tensor's memory as it lies."""
    return {
        "model": {
            "big": random_tensor(torch.float32, (1536, 1024 + 3), 1),  # ~6 MiB: 7 chunks of 1 MiB
            "bf": random_tensor(torch.bfloat16, (333,), 2),
            "odd": random_tensor(torch.uint8, (7,), 3),
            "b": random_tensor(torch.bool, (9,), 4),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.empty(0, 4),
            "t": random_tensor(torch.float64, (64, 48), 5).t(),
            "c": random_tensor(torch.complex64, (8, 8), 6).conj(),
        },
        "step": 3,
    }


def clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone().resolve_conj()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    return obj


def file_crcs(path, manifest: Manifest) -> dict[str, tuple[int, int]]:
    """tensor -> (CRC in the manifest, CRC-32C of the bytes the data file holds there), for every piece."""
    out = {}
    for name, t in manifest.tensors.items():
        for p in t.pieces:
            with open(path / p.file, "rb") as f:
                f.seek(p.offset)
                out[name] = (p.crc32c, crc32c.crc32c(f.read(p.length)))
    return out


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(sys.modules["ucp.saving.snapshot"], "COPY_CHUNK", 1 << 20)


IN_PROCESS = ["sync", "background"] + ([COW] if COW else [])  # snapshots whose writer is a thread of this process


@pytest.mark.parametrize("backend", ["extension", "fallback"])
@pytest.mark.parametrize("snapshot", IN_PROCESS)
def test_the_copy_checksums_contiguous_host_pieces_and_the_writer_only_the_others(
    tmp_path, monkeypatch, small_chunks, backend, snapshot
):
    """The writer checksums only what torch copied; the copy's CRCs (the helper's, for cow) are the file's."""
    if backend == "fallback":  # the pure-torch copy_crc32c (no compiler, UCP_KERNELS=torch): same CRCs
        monkeypatch.setattr(sys.modules["kernels.crc"], "extension", lambda: (None, "forced by the test"))
    seen: dict = {}
    fed: list[int] = []
    real_write_image, real_feed_many = _execute.write_image, _writer.CrcChain.feed_many

    def write_image(storage, rel, plan, arena, progress):
        seen["names"] = [p.name for p in plan.pieces]
        seen["progress"] = progress
        return real_write_image(storage, rel, plan, arena, progress)

    def feed_many(self, parts):
        fed.extend(i for i, _ in parts)
        return real_feed_many(self, parts)

    monkeypatch.setattr(_execute, "write_image", write_image)
    monkeypatch.setattr(_writer.CrcChain, "feed_many", feed_many)
    src = state()
    with AsyncSaver(mode="thread", snapshot=snapshot) as saver:
        manifest = saver.save(src, tmp_path / "ck").result(timeout=120)

    names, progress = seen["names"], seen["progress"]
    declared = {names[i] for i in progress.checksummed}
    assert declared == set(names) - NOT_IN_PLACE
    on_disk = file_crcs(tmp_path / "ck", manifest)
    for i in progress.checksummed:  # the copy's CRC is the written bytes' CRC, and the manifest's
        assert progress.crcs[i] == on_disk[names[i]][1] == on_disk[names[i]][0], names[i]
    assert {names[i] for i in fed} == NOT_IN_PLACE  # the writer read back nothing the copy checksummed
    assert all(m == f for m, f in on_disk.values())
    assert_same_state(clone(src), ucp.load(tmp_path / "ck"))


@pytest.mark.parametrize("mode,snapshot", SAVERS, ids=[f"{m}-{s}" for m, s in SAVERS])
def test_every_snapshot_mode_writes_the_crc32c_of_its_bytes_verifies_and_loads_bit_exactly(
    tmp_path, small_chunks, mode, snapshot
):
    src = state()
    expected = clone(src)
    with AsyncSaver(mode=mode, snapshot=snapshot) as saver:
        for k in range(2):  # the second save reuses the staging arena (and its old bytes)
            manifest = saver.save(src, tmp_path / f"ck{k}", step=k).result(timeout=120)
            on_disk = file_crcs(tmp_path / f"ck{k}", manifest)
            assert sorted(on_disk) == sorted(f"model.{n}" for n in expected["model"])
            assert {n: m for n, (m, _) in on_disk.items()} == {n: f for n, (_, f) in on_disk.items()}
            report = ucp.verify(tmp_path / f"ck{k}")
            assert report.ok and report.pieces_checked == len(on_disk), report.problems
            assert_same_state(expected, ucp.load(tmp_path / f"ck{k}"))


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_damaged_byte_in_a_piece_checksummed_by_the_copy_is_named_by_verify_and_load(tmp_path, small_chunks, mode):
    with AsyncSaver(mode=mode, snapshot="sync") as saver:
        manifest = saver.save(state(), tmp_path / "ck").result(timeout=120)
    (piece,) = manifest.tensors["model.big"].pieces
    data = tmp_path / "ck" / piece.file
    raw = bytearray(data.read_bytes())
    raw[piece.offset + piece.length // 2 + 1] ^= 0x10  # one bit, in the fourth of the piece's seven chunks
    data.write_bytes(bytes(raw))

    report = ucp.verify(tmp_path / "ck")
    assert not report.ok
    assert [(p.kind, p.tensor) for p in report.problems] == [("CorruptCheckpointError", "model.big")]
    with pytest.raises(ucp.errors.CorruptCheckpointError, match="model.big"):
        ucp.load(tmp_path / "ck")
