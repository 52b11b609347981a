"""A Ctrl-C landing just after a staging block or an engine slot was taken never loses it.

Blocks and slots are bounded: one taken but not yet recorded where its release finds it would be
gone for good, and enough of those make every later take wait forever. The takes run with the
signal handlers held (aio.engines.base.signals_held), so the KeyboardInterrupt comes once the block
or slot is recorded; a Ctrl-C during a long wait still ends the wait, with nothing taken.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

from aio import AioConfig, AioHandle
from aio.buffers import BufferPool

KIB = 1 << 10
BS = 64 * KIB


class _SigintOnTake(BufferPool):
    """A pool whose next take is followed at once by a Ctrl-C (raised in the main thread)."""

    armed = False

    def acquire(self, timeout: float | None = None):
        block = super().acquire(timeout)
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            signal.raise_signal(signal.SIGINT)
        return block


def _arm(io: AioHandle) -> _SigintOnTake:
    io.pool.__class__ = _SigintOnTake
    io.pool.armed = True  # type: ignore[attr-defined]
    return io.pool  # type: ignore[return-value]


def _all_back(io: AioHandle) -> bool:
    return len(io.pool._free) == io.pool._created


@pytest.mark.parametrize("engine", ["threads", "libaio"])
def test_ctrl_c_right_after_a_writer_takes_its_staging_block(disk_dir, make_data, engine: str) -> None:
    data = make_data(3 * BS + 100, seed=3)
    try:
        io = AioHandle(AioConfig(engine=engine, block_size=BS, queue_depth=2))
    except Exception as exc:  # noqa: BLE001 - libaio missing here
        pytest.skip(f"{engine}: {exc}")
    with io:
        _arm(io)
        path = disk_dir / "w.bin"
        with pytest.raises(KeyboardInterrupt):
            with io.writer(path, size_hint=data.nbytes) as w:
                w.write(data[:1000])  # staged: takes a block
        assert not path.exists() and _all_back(io)
        io.write_file(path, data)  # the pool still serves every block it had
        assert io.read_file(path).view(data.nbytes).tobytes() == data.tobytes()


@pytest.mark.parametrize("engine", ["threads", "libaio"])
def test_ctrl_c_right_after_a_staged_read_takes_its_block(disk_dir, make_data, engine: str) -> None:
    data = make_data(2 * BS, seed=4)
    try:
        io = AioHandle(AioConfig(engine=engine, block_size=BS, queue_depth=2))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"{engine}: {exc}")
    with io:
        path = disk_dir / "r.bin"
        io.write_file(path, data)
        _arm(io)
        dest = np.zeros(BS // 2, np.uint8)
        with pytest.raises(KeyboardInterrupt):
            io.read_into(path, 3, dest)  # unaligned: one staged read
        assert _all_back(io)
        again = np.zeros(BS // 2, np.uint8)
        io.read_into(path, 5, again)
        assert again.tobytes() == data[5 : 5 + BS // 2].tobytes() and _all_back(io)


def test_ctrl_c_right_after_libaio_takes_a_slot(disk_dir, make_data) -> None:
    """The request owns its slot before the KeyboardInterrupt: every slot is free again once it completes."""
    try:
        io = AioHandle(AioConfig(engine="libaio", block_size=BS, queue_depth=2))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"libaio: {exc}")
    data = make_data(4 * BS, seed=5)
    with io:
        engine: Any = io.engine  # a LibaioEngine whose private slots are swapped for a spy below
        real = engine._slots

        class SigintOnSlot:
            armed = True

            def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
                got = real.acquire(blocking, timeout)
                if got and self.armed:
                    self.armed = False
                    signal.raise_signal(signal.SIGINT)
                return got

            def release(self) -> None:
                real.release()

        engine._slots = SigintOnSlot()
        path = disk_dir / "s.bin"
        with pytest.raises(KeyboardInterrupt):
            io.write_file(path, data)
        engine._slots = real
        assert real._value == 2, "a slot was lost"  # BoundedSemaphore: all free once nothing is in flight
        io.write_file(path, data)
        assert io.read_file(path).view(data.nbytes).tobytes() == data.tobytes()


def test_ctrl_c_still_ends_a_long_wait_for_a_block(disk_dir, make_data) -> None:
    """With every block taken elsewhere, a writer waits; a Ctrl-C ends that wait (nothing taken)."""
    with AioHandle(AioConfig(engine="threads", block_size=BS, queue_depth=1)) as io:
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        held = []
        try:
            with pytest.raises(KeyboardInterrupt):
                with io.writer(disk_dir / "x.bin") as w:  # (the writer raises the pool's bound by its one block)
                    while True:
                        try:
                            held.append(io.pool.acquire(timeout=0))
                        except TimeoutError:
                            break
                    timer.start()
                    w.write(make_data(100, seed=6))
        finally:
            timer.cancel()
        assert held
        for b in held:
            io.pool.release(b)
        assert _all_back(io)
