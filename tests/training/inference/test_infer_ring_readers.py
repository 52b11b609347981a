"""The host arena's reader threads (the cpu path's ring): parts wrap around its buffer without a read ever
landing on bytes compute holds or another read is filling, reads overlap, parts reach compute in order
whichever read ends first, and a failed read is raised at its own part."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable

import pytest
import torch

from training.inference.executor import _Arena
from training.inference.layout import GroupLayout, Placed

SLOT = 4096


class Recorder:
    """A RangeReader for files named by part number that fills each range with that number, slowly enough
    for reads to overlap, recording the arena bytes in flight (``arena``: the buffer's address range)."""

    engine_name = "fake"

    def __init__(self, fail: str | None = None) -> None:
        self.base, self.fail, self.lock = 0, fail, threading.Lock()
        self.ready = threading.Event()  # set once ``base`` is the arena's address
        self.flight: dict[int, tuple[int, int]] = {}  # id -> (start, end) in the arena
        self.most = self.most_bytes = 0

    def read_ranges(self, file: str, ranges: Iterable[tuple[int, Any]]) -> None:
        self.ready.wait()
        ranges = list(ranges)
        spans = [(ctypes_address(d) - self.base, len(d)) for _, d in ranges]
        with self.lock:
            for s, n in spans:
                for a, b in self.flight.values():  # two reads in flight never share a byte
                    assert s + n <= a or b <= s, "overlapping reads in the arena"
                self.flight[id(spans)] = (spans[0][0], spans[0][0] + spans[0][1])
            self.most = max(self.most, len(self.flight))
            self.most_bytes = max(self.most_bytes, sum(b - a for a, b in self.flight.values()))
        try:
            time.sleep(0.01 * (1 + int(file) % 3))
            if file == self.fail:
                raise OSError(f"{file}: unreadable")
            for _, dest in ranges:
                dest[:] = bytes([int(file)]) * len(dest)
        finally:
            with self.lock:
                del self.flight[id(spans)]

    def close(self) -> None:
        pass


def ctypes_address(view: Any) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def part(i: int, pages: int) -> GroupLayout:
    n = pages * SLOT
    return GroupLayout("g", [], reads={str(i): [(0, 0, n)]}, tensors=[Placed(f"t{i}", "U8", (n,), 0, n)], nbytes=n)


@pytest.mark.parametrize("arena_pages", [3, 4, 7])  # exactly the largest part (no overlap); a few; more
def test_arena_parts_wrap_and_reach_compute_in_order_intact(arena_pages: int) -> None:
    parts = [part(i, p) for i, p in enumerate([1, 3, 2, 1, 3, 2])]  # a pass; wraps at every arena size
    reader = Recorder()
    arena = _Arena(parts, arena_pages * SLOT, reader, readers=3, dtype=torch.uint8)
    reader.base = arena.buffer.address
    reader.ready.set()
    try:
        for k in range(3 * len(parts)):  # three passes; compute releases a part before it takes the next
            i = k % len(parts)
            (view,) = arena.take(i).values()
            assert bool((view == i).all()), f"part {i} got another part's bytes"
            time.sleep(0.02)  # compute: the reads of later parts go on meanwhile
            assert bool((view == i).all()), f"part {i} was read over while compute held it"
            arena.release()
    finally:
        arena.close()
    assert reader.most_bytes <= arena.nbytes
    assert reader.most >= 2  # reads overlap (small parts beside each other even in an arena of the largest)
    assert arena.stats.groups_read >= 3 * len(parts)
    assert arena.stats.bytes_read == sum(parts[i % len(parts)].read_bytes for i in range(arena.stats.groups_read))


def test_an_arena_read_failure_is_raised_at_its_own_part() -> None:
    parts = [part(i, 1) for i in range(4)]
    reader = Recorder(fail="2")
    arena = _Arena(parts, 4 * SLOT, reader, readers=2, dtype=torch.uint8)
    reader.base = arena.buffer.address
    reader.ready.set()
    try:
        for k in range(2):
            arena.take(k)
            arena.release()
        with pytest.raises(OSError, match="2: unreadable"):
            arena.take(2)
    finally:
        arena.close()
