"""The host ring's reader threads: the next group's read is in flight while the last one finishes, and
groups still reach compute in order (and an error at its group) whichever read ends first."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable

import pytest

from training.inference.executor import _Ring
from training.inference.layout import GroupLayout

SLOT = 4096


class SlowEvenReader:
    """A RangeReader for files named by group number: fills each range with that number; even groups
    read slowly, so the odd group after one finishes first; ``fail`` names a file that cannot be read."""

    engine_name = "fake"

    def __init__(self, fail: str | None = None) -> None:
        self.fail, self.lock = fail, threading.Lock()
        self.active = self.most = 0
        self.finished: list[int] = []

    def read_ranges(self, file: str, ranges: Iterable[tuple[int, Any]]) -> None:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            time.sleep(0.2 if int(file) % 2 == 0 else 0.01)
            if file == self.fail:
                raise OSError(f"{file}: unreadable")
            for _, dest in ranges:
                dest[:] = bytes([int(file)]) * len(dest)
        finally:
            with self.lock:
                self.active -= 1
                self.finished.append(int(file))

    def close(self) -> None:
        pass


def groups(n: int) -> list[GroupLayout]:
    return [GroupLayout(f"layer {i}", [], reads={str(i): [(0, 0, SLOT)]}, nbytes=SLOT) for i in range(n)]


def test_two_readers_overlap_and_hand_groups_over_in_order() -> None:
    reader = SlowEvenReader()
    ring = _Ring(groups(4), 3, SLOT, reader, readers=2)
    try:
        for k in range(8):  # two passes
            buf = ring.take(k % 4)
            assert bytes(buf.view(SLOT)) == bytes([k % 4]) * SLOT, f"group {k % 4} got another group's bytes"
            ring.release(buf)
    finally:
        ring.close()
    assert reader.most == 2  # the next group was read while the slow one was still in flight
    assert reader.finished.index(1) < reader.finished.index(0)  # ... and finished first, yet came second
    assert ring.stats.groups_read >= 8 and ring.stats.bytes_read == ring.stats.groups_read * SLOT
    assert 0.0 < ring.stats.read_seconds < 8 * 0.2  # busy wall time, not the sum of overlapping reads


def test_a_failed_read_is_raised_at_its_own_group() -> None:
    reader = SlowEvenReader(fail="1")
    ring = _Ring(groups(3), 3, SLOT, reader, readers=2)
    try:
        buf = ring.take(0)  # group 0, read slowly, still arrives though group 1 failed before it
        assert bytes(buf.view(SLOT)) == bytes([0]) * SLOT
        ring.release(buf)
        with pytest.raises(OSError, match="1: unreadable"):
            ring.take(1)
    finally:
        ring.close()
