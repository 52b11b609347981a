"""A StreamedShard is saved as the ordinary piece its bytes make: the same manifest pieces and CRCs as the
tensor it stands for, even when every part comes from one reused buffer; an asynchronous save in thread mode
pulls its parts on the writer thread (the other tensors copied before it returns), one in process mode refuses it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch

import ucp
from reshard.box import Box, FlatRange
from ucp.errors import LayoutMismatchError, UnsupportedStateError
from ucp.format.sharding import FlatShard, ShardedTensor, Shards, StreamedShard
from ucp.saving.snapshot import tensor_bytes

PART = 4096  # bytes per part, all through one buffer


def reused(t: torch.Tensor) -> Iterator[memoryview]:
    """``t``'s bytes part by part, each copied into the same buffer (overwritten when the next is asked for)."""
    src = tensor_bytes(t.contiguous())
    buf = bytearray(PART)
    for a in range(0, src.nbytes, PART):
        n = min(PART, src.nbytes - a)
        buf[:n] = src[a : a + n]
        yield memoryview(buf)[:n]


def test_streamed_pieces_are_the_pieces_of_the_tensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300_000, generator=g)  # large: written in many parts
    box = torch.randn(64, 48, generator=g)
    flat, boxed = big[1000:], box[16:]
    plain = {
        "a": Shards([FlatShard(flat, (300_000,), 1000), FlatShard(big[:1000], (300_000,), 0)]),
        "b": Shards([ShardedTensor(boxed, (64, 48), (16, 0)), ShardedTensor(box[:16], (64, 48), (0, 0))]),
        "c": torch.arange(10),
    }
    streamed = {
        "a": Shards(
            [
                StreamedShard(torch.float32, (300_000,), FlatRange(1000, 300_000), lambda: reused(flat)),
                FlatShard(big[:1000], (300_000,), 0),
            ]
        ),
        "b": Shards(
            [
                StreamedShard(torch.float32, (64, 48), Box((16, 0), (48, 48)), lambda: reused(boxed)),
                ShardedTensor(box[:16], (64, 48), (0, 0)),
            ]
        ),
        "c": torch.arange(10),
    }
    ucp.save(plain, tmp_path / "plain")
    ucp.save(streamed, tmp_path / "streamed")
    ours, theirs = ucp.read_manifest(tmp_path / "streamed"), ucp.read_manifest(tmp_path / "plain")
    assert ours.tensors.keys() == theirs.tensors.keys()
    for name in ours.tensors:
        mine = {(repr(p.region()), p.crc32c, p.length) for p in ours.tensors[name].pieces}
        assert mine == {(repr(p.region()), p.crc32c, p.length) for p in theirs.tensors[name].pieces}, name
    loaded = ucp.load(tmp_path / "streamed")
    assert torch.equal(loaded["a"], big) and torch.equal(loaded["b"], box)
    assert ucp.verify(tmp_path / "streamed").ok


def test_a_streamed_shard_with_too_few_bytes_fails_the_save(tmp_path: Path) -> None:
    short = StreamedShard(torch.float32, (100,), FlatRange(0, 100), lambda: reused(torch.ones(99)))
    with pytest.raises(RuntimeError, match="piece 'a' got 396 bytes, the plan says 400"):
        ucp.save({"a": short}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("snapshot", ["sync", "none"])
def test_a_thread_mode_async_save_pulls_a_streamed_shard_on_its_writer(tmp_path: Path, snapshot: str) -> None:
    big = torch.arange(300_000, dtype=torch.float32)
    plain = torch.arange(1000, dtype=torch.float32)
    pulled: list[str] = []

    def parts() -> Iterator[memoryview]:
        pulled.append(threading.current_thread().name)
        yield from reused(big)

    shard = StreamedShard(torch.float32, (300_000,), FlatRange(0, 300_000), parts)
    with ucp.AsyncSaver(snapshot=snapshot) as saver:  # type: ignore[arg-type]
        handle = saver.save({"w": shard, "p": plain}, tmp_path / "async")
        plain += 1  # the plain tensor was copied before save returned
        handle.result()
    assert pulled == ["ucp-async-writer"]  # on the writer thread, once
    loaded = ucp.load(tmp_path / "async")
    assert torch.equal(loaded["w"], big) and torch.equal(loaded["p"], plain - 1)
    assert ucp.verify(tmp_path / "async").ok


def test_a_process_mode_async_save_refuses_a_streamed_shard(tmp_path: Path) -> None:
    shard = StreamedShard(torch.float32, (8,), FlatRange(0, 8), lambda: reused(torch.ones(8)))
    with ucp.AsyncSaver(mode="process") as saver, pytest.raises(UnsupportedStateError, match="needs mode='thread'"):
        saver.save({"w": shard}, tmp_path / "async").result()


def test_a_load_into_a_streamed_shard_names_the_tensor(tmp_path: Path) -> None:
    t = torch.ones(8)
    ucp.save({"w": t}, tmp_path / "c")
    shard = StreamedShard(torch.float32, (8,), FlatRange(0, 8), lambda: reused(t))
    with pytest.raises(LayoutMismatchError, match=r"\['w'\] \(tensor 'w'\): a StreamedShard is written by a save"):
        ucp.load(tmp_path / "c", into={"w": shard})


def test_a_phase_puts_a_large_streamed_piece_in_phase_with_its_parts(tmp_path: Path) -> None:
    big = torch.arange(200_000, dtype=torch.float32)
    shard = StreamedShard(torch.float32, (200_000,), FlatRange(0, 200_000), lambda: reused(big), phase=1000)
    ucp.save({"a": torch.ones(3), "w": shard}, tmp_path / "c")
    (piece,) = ucp.read_manifest(tmp_path / "c").tensors["w"].pieces
    assert piece.offset % 4096 == 1000
    assert torch.equal(ucp.load(tmp_path / "c")["w"], big)


def test_streamed_saves_in_flight_are_bounded_by_max_in_flight(tmp_path: Path) -> None:
    gate = threading.Event()

    def held() -> Iterator[memoryview]:
        gate.wait(30)  # the first save's writer waits here until the second save has been seen to wait
        yield from reused(torch.ones(8))

    first = StreamedShard(torch.float32, (8,), FlatRange(0, 8), held)
    second = StreamedShard(torch.float32, (8,), FlatRange(0, 8), lambda: reused(torch.zeros(8)))
    with ucp.AsyncSaver(max_in_flight=1, snapshot="sync") as saver:
        a = saver.save({"w": first}, tmp_path / "a")
        handles: list[ucp.SaveHandle] = []
        later = threading.Thread(target=lambda: handles.append(saver.save({"w": second}, tmp_path / "b")))
        later.start()
        later.join(0.5)
        assert later.is_alive() and not handles  # save() itself waits: the first save is still writing its file
        gate.set()
        later.join(30)
        assert len(handles) == 1
        a.result()
        handles[0].result()
    assert torch.equal(ucp.load(tmp_path / "a")["w"], torch.ones(8))
    assert torch.equal(ucp.load(tmp_path / "b")["w"], torch.zeros(8))
