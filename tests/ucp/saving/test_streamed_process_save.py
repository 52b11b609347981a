"""A process-mode asynchronous save of StreamedShards that have a ``source`` (blocks of files on disk with known
CRC-32Cs): the writer process reads them itself, block by block, so the training process stages only the other
tensors (a compact arena); the checkpoint is the one a synchronous save writes; it waits for the shards' ``ready``;
a block whose bytes changed fails the save naming the file and the block; a writer killed while it waits leaves
the last committed checkpoint loadable."""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future
from pathlib import Path
from typing import Iterator

import crc32c
import pytest
import torch

import ucp
from reshard.box import Box, FlatRange
from ucp.errors import CommitError, CorruptCheckpointError
from ucp.format.sharding import Shards, StreamedShard
from ucp.saving.snapshot import tensor_bytes
from ucp.store.file_ranges import FileRange

BLOCK = 64 << 10  # bytes per checked block of the source file


def source_file(path: Path, t: torch.Tensor) -> list[FileRange]:
    """Write ``t``'s bytes to ``path`` in blocks of BLOCK (the last one padded), with their CRCs: its ranges."""
    data = bytes(tensor_bytes(t.contiguous()))
    ranges = []
    with open(path, "wb") as f:
        for k, at in enumerate(range(0, len(data), BLOCK)):
            chunk = data[at : at + BLOCK]
            block = chunk + bytes(BLOCK - len(chunk))
            f.write(block)
            crc = crc32c.crc32c(block)
            ranges.append(FileRange(path=str(path), offset=at, length=BLOCK, crc32c=crc, start=0, stop=len(chunk), what=f"block {k}", alignment=4096))  # fmt: skip
    return ranges


def unused() -> Iterator[memoryview]:
    raise AssertionError("a process-mode save must read the source, not call parts()")


def state(tmp_path: Path, ready: Future[None] | None = None) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(200_000, generator=g)  # 781 KiB: 13 blocks
    box = torch.randn(64, 48, generator=g)
    plain = {"big": big, "box": box, "small": torch.arange(10)}
    lo = source_file(tmp_path / "big.bin", big[:150_000])
    hi = source_file(tmp_path / "big-hi.bin", big[150_000:])
    rows = source_file(tmp_path / "box.bin", box[16:])
    streamed = {
        "big": Shards(
            [
                StreamedShard(torch.float32, (200_000,), FlatRange(0, 150_000), unused, source=lambda: lo, ready=ready),
                StreamedShard(
                    torch.float32, (200_000,), FlatRange(150_000, 200_000), unused, source=lambda: hi, ready=ready
                ),
            ]
        ),
        "box": Shards(
            [
                StreamedShard(
                    torch.float32, (64, 48), Box((16, 0), (48, 48)), unused, source=lambda: rows, ready=ready
                ),
                ucp.ShardedTensor(box[:16].clone(), (64, 48), (0, 0)),
            ]
        ),
        "small": torch.arange(10),
    }
    return plain, streamed


def test_the_writer_process_reads_the_sources_and_writes_the_synchronous_checkpoint(tmp_path: Path) -> None:
    plain, streamed = state(tmp_path)
    ucp.save(plain, tmp_path / "sync")
    with ucp.AsyncSaver(mode="process") as saver:
        saver.save(streamed, tmp_path / "async").result()
        staged = saver.pool.created_bytes
    ours, theirs = ucp.read_manifest(tmp_path / "async"), ucp.read_manifest(tmp_path / "sync")
    assert ours.tensors.keys() == theirs.tensors.keys()
    loaded, expected = ucp.load(tmp_path / "async"), ucp.load(tmp_path / "sync")
    assert all(torch.equal(loaded[k], expected[k]) for k in plain)
    assert ucp.verify(tmp_path / "async").ok  # every piece's CRC-32C is that of the bytes written
    # the streamed 831 KiB never went through this process's staging: the arena held the header and the rest
    assert staged < 16 << 10, staged


def test_the_writer_waits_for_the_sources_to_be_ready(tmp_path: Path) -> None:
    ready: Future[None] = Future()
    plain, streamed = state(tmp_path, ready)
    with ucp.AsyncSaver(mode="process") as saver:
        handle = saver.save(streamed, tmp_path / "async")
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.3)
        ready.set_result(None)
        handle.result()
    assert torch.equal(ucp.load(tmp_path / "async")["big"], plain["big"])

    failed: Future[None] = Future()
    _, streamed = state(tmp_path, failed)
    with ucp.AsyncSaver(mode="process") as saver:
        handle = saver.save(streamed, tmp_path / "failed")
        failed.set_exception(OSError(28, "No space left on device"))
        with pytest.raises(Exception, match="No space left on device"):
            handle.result()
    assert not (tmp_path / "failed").exists()


def test_a_changed_block_fails_the_save_naming_the_file_and_block(tmp_path: Path) -> None:
    _, streamed = state(tmp_path)
    with open(tmp_path / "big-hi.bin", "r+b") as f:
        os.pwrite(f.fileno(), b"\x7f" * 16, BLOCK + 100)  # inside block 1
    with ucp.AsyncSaver(mode="process") as saver:
        handle = saver.save(streamed, tmp_path / "async")
        with pytest.raises(
            CorruptCheckpointError, match=r"big-hi\.bin \(block 1\) is corrupt: bytes \[65536, 131072\)"
        ):
            handle.result()
    assert not (tmp_path / "async").exists()


def test_a_writer_killed_mid_save_leaves_the_last_checkpoint_loadable(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    plain, done = state(tmp_path)
    fifo = tmp_path / "stuck"
    os.mkfifo(fifo)  # the writer blocks opening it: killed while it reads the source
    stuck = [FileRange(path=str(fifo), offset=0, length=BLOCK, crc32c=0, start=0, stop=40, what="stuck")]
    pending = {"w": StreamedShard(torch.float32, (10,), FlatRange(0, 10), unused, source=lambda: stuck)}
    with ucp.CheckpointManager(root, async_save=True, mode="process") as m:
        first = m.save(done, 1)
        assert isinstance(first, ucp.SaveHandle)
        first.result()
        handle = m.save(pending, 2)
        assert isinstance(handle, ucp.SaveHandle)
        pid = m.saver.writer_pid if m.saver is not None else None
        assert pid is not None
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.5)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CommitError, match="exited"):
            handle.result(timeout=30)
        assert m.latest() == 1
    loaded = ucp.load(ucp.CheckpointManager(root).path(1))
    assert torch.equal(loaded["big"], plain["big"]) and torch.equal(loaded["box"], plain["box"])


def test_a_saver_closed_before_the_sources_are_ready_fails_the_save(tmp_path: Path) -> None:
    ready: Future[None] = Future()
    _, streamed = state(tmp_path, ready)
    saver = ucp.AsyncSaver(mode="process")
    handle = saver.save(streamed, tmp_path / "async")
    saver.close(wait=False)
    ready.set_result(None)
    with pytest.raises(RuntimeError, match="closed before the streamed state was ready"):
        handle.result(timeout=30)
    assert saver.writer_pid is None  # no writer process started for it
    assert not (tmp_path / "async").exists()
