"""The submit protocol of the aio engines (``future=``, set running once taken) and what the handle
builds on it: after an interrupt or failure anywhere in a submit, every staging block goes back to
the pool exactly once, no future is left pending forever, and no call returns (or raises) while the
device still uses the caller's memory.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from concurrent.futures import Future, wait

import numpy as np
import pytest

from aio import AioConfig, AioError, AioHandle, AlignedBuffer, ThreadEngine
from aio.engines.base import pread_full, pwrite_full
from aio.files import open_file

KIB = 1 << 10
BS = 8 * KIB


def _pool_intact(io: AioHandle) -> bool:
    return len(io.pool._free) == io.pool._created  # noqa: SLF001


def _libaio():
    try:
        from aio.engines.libaio_engine import LibaioEngine, _raw

        engine = LibaioEngine(4)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"libaio unavailable: {exc}")
    return engine, _raw


class _TakeThenInterrupt(ThreadEngine):
    """Takes its first request of ``kind`` (held by ``gate``), then raises KeyboardInterrupt as a Ctrl-C
    landing just after the engine took it would; ``gate`` opens 0.3 s later."""

    max_segments = 1  # every read through submit_read, which this engine hooks

    def __init__(self, kind: str) -> None:
        super().__init__(2)
        self.kind = kind
        self.gate = threading.Event()
        self.taken: list[Future] = []

    def _gated(self, move):
        def run(f, offset, buf) -> int:
            self.gate.wait(10)
            return move(f, offset, buf)

        return run

    def submit_read(self, f, offset, buf, future=None):
        return self._take("read", pread_full, f, offset, buf, future)

    def submit_write(self, f, offset, buf, future=None):
        return self._take("write", pwrite_full, f, offset, buf, future)

    def _take(self, kind, move, f, offset, buf, future):
        first = kind == self.kind and not self.taken
        fut = self._start(self._gated(move) if first else move, f, offset, buf, future or Future())
        if first:
            self.taken.append(fut)
            threading.Timer(0.3, self.gate.set).start()
            raise KeyboardInterrupt
        return fut


# -- bugs ---------------------------------------------------------------------------------------------


def test_interrupt_after_the_engine_took_a_direct_read_waits_for_it(disk_dir, make_data):
    data = make_data(2 * BS, seed=1)
    path = disk_dir / "f.bin"
    engine = _TakeThenInterrupt("read")
    with AioHandle(AioConfig(block_size=BS, queue_depth=4), engine=engine) as io:
        io.write_file(path, data)
        dest = AlignedBuffer(BS, pin=False).numpy()  # aligned address and offset: read straight into dest
        try:
            with pytest.raises(KeyboardInterrupt):
                io.read_into(path, 0, dest)
            assert engine.taken[0].done(), "read_into raised while the device still writes into dest"
            assert dest.tobytes() == data[:BS].tobytes()
        finally:
            engine.gate.set()
            wait(engine.taken, 10)  # (with the bug it then reads on a closed fd: EBADF)


def test_interrupt_while_the_writer_waits_for_a_free_slot_keeps_the_awaited_write(disk_dir):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread (signals)")
    gates = [threading.Event(), threading.Event()]
    taken: list[Future] = []

    class Gated(ThreadEngine):
        def submit_write(self, f, offset, buf, future=None):
            k = len(taken)

            def run(f, offset, buf) -> int:
                if k < 2:
                    gates[k].wait(10)
                return pwrite_full(f, offset, buf)

            fut = self._start(run, f, offset, buf, future or Future())
            taken.append(fut)
            return fut

    main = threading.main_thread().ident

    def interrupt() -> None:
        while len(taken) < 2:
            time.sleep(0.01)
        time.sleep(0.3)  # the writer now waits for write 0 (queue depth 2)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.2)
        gates[1].set()  # abort() waits for write 1
        time.sleep(2.0)
        gates[0].set()  # a fixed abort() waits for write 0 too

    engine = Gated(2)
    path = disk_dir / "w.bin"
    with AioHandle(AioConfig(block_size=BS, queue_depth=2, use_direct=False), engine=engine) as io:
        t = threading.Thread(target=interrupt)
        t.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                with io.writer(path) as w:
                    w.write(bytes(4 * BS))
            assert taken[0].done(), "the writer gave up (file deleted) with a write still in flight"
        finally:
            t.join()
            wait(taken, 10)
        assert taken[0].exception() is None  # it ran after abort() closed its file: EBADF (or another file's fd)
        assert not path.exists()
        assert _pool_intact(io)


def test_libaio_process_ctrl_c_inside_the_held_block_never_leaves_a_running_future_behind(disk_dir, monkeypatch):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread (signals)")
    engine, raw = _libaio()
    real = raw.io_submit
    calls = []

    def io_submit(ctx, n, iocbs):
        if not calls:
            calls.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C: to the process, not to a thread
            time.sleep(0.3)  # main holds SIGINT back; another thread's handler flags it meanwhile
        return real(ctx, n, iocbs)

    monkeypatch.setattr(raw, "io_submit", io_submit)
    path = disk_dir / "r.bin"
    path.write_bytes(bytes(range(256)) * 16)
    buf = AlignedBuffer(4096, pin=False)
    fut: Future = Future()
    f = open_file(path, "r", direct=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.submit_read(f, 0, buf.view(), fut)
            time.sleep(0.5)  # the KeyboardInterrupt comes here at the latest
        # Either never taken (pending) or the engine completes it.
        assert not fut.running() or fut.result(3) == 4096
    finally:
        with engine._lock:  # noqa: SLF001 - let close() finish whatever the interrupt stranded
            stranded, engine._inflight = list(engine._inflight.values()), {}  # noqa: SLF001
        for req in stranded:
            if not req.future.done():
                req.future.set_exception(RuntimeError("stranded"))
        engine.close()
        f.close()


def test_libaio_io_submit_failing_after_the_reaper_failed_the_request_raises_aio_error(disk_dir, monkeypatch):
    engine, raw = _libaio()

    def io_submit(ctx, n, iocbs):
        engine._fail_all(OSError(errno.EIO, "getevents failed"), "io_getevents")  # noqa: SLF001 - the reaper's race
        raise OSError(errno.EINVAL, "bad context")

    path = disk_dir / "r.bin"
    path.write_bytes(bytes(4096))
    buf = AlignedBuffer(4096, pin=False)
    f = open_file(path, "r", direct=False)
    monkeypatch.setattr(raw, "io_submit", io_submit)
    try:
        fut: Future = Future()
        with pytest.raises(AioError):
            engine.submit_read(f, 0, buf.view(), fut)
        assert fut.done() and isinstance(fut.exception(), AioError)
    finally:
        monkeypatch.undo()
        engine.close()
        f.close()


# -- regression tests -----------------------------------------------------------------------------------


def test_interrupt_after_the_engine_took_a_staged_write_keeps_the_block_until_done(disk_dir, make_data):
    data = make_data(3 * BS, seed=2)
    engine = _TakeThenInterrupt("write")
    path = disk_dir / "w.bin"
    with AioHandle(AioConfig(block_size=BS, queue_depth=4), engine=engine) as io:
        with pytest.raises(KeyboardInterrupt):
            with io.writer(path) as w:
                w.write(data.tobytes())
        assert engine.taken[0].done(), "abort() returned with the interrupted write still in flight"
        assert not path.exists()
        assert _pool_intact(io)
        io.write_file(path, data)
        assert io.read_file(path).numpy().tobytes() == data.tobytes()


def test_interrupted_staged_read_waits_and_returns_the_block_once(disk_dir, make_data):
    data = make_data(4 * BS, seed=3)
    engine = _TakeThenInterrupt("read")
    path = disk_dir / "f.bin"
    with AioHandle(AioConfig(block_size=BS, queue_depth=4), engine=engine) as io:
        io.write_file(path, data)
        dest = np.zeros(BS // 2, np.uint8)
        with pytest.raises(KeyboardInterrupt):
            io.read_into(path, 5, dest)
        assert engine.taken[0].done()
        assert dest.tobytes() == data[5 : 5 + BS // 2].tobytes()
        assert _pool_intact(io)


@pytest.mark.parametrize("engine_name", ["threads", "libaio"])
def test_many_refused_submits_never_shrink_or_grow_the_pool(disk_dir, make_data, engine_name):
    """Submits refused by a closed engine: every staging block back, each once, futures all done."""
    data = make_data(3 * BS + 17, seed=4)
    path = disk_dir / "f.bin"
    cfg = AioConfig(engine=engine_name, block_size=BS, queue_depth=2)
    try:
        io = AioHandle(cfg)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"{engine_name}: {exc}")
    with io:
        io.write_file(path, data)
        io.engine.close()  # the engine goes away under the handle
        for i in range(20):
            with pytest.raises((ValueError, AioError)):
                io.read_into(path, 1 + i, np.zeros(2 * BS, np.uint8))
            with pytest.raises((ValueError, AioError)):
                with io.writer(disk_dir / f"w{i}.bin") as w:
                    w.write(data.tobytes())
            assert not (disk_dir / f"w{i}.bin").exists()
        assert _pool_intact(io)
        assert io.pool._created <= io.pool.max_buffers  # noqa: SLF001


@pytest.mark.parametrize("engine_name", ["threads", "libaio"])
def test_zero_length_requests_complete_the_given_future(disk_dir, engine_name):
    path = disk_dir / "f.bin"
    path.write_bytes(b"x" * 4096)
    try:
        io = AioHandle(AioConfig(engine=engine_name, block_size=BS))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"{engine_name}: {exc}")
    with io, open_file(path, "r", direct=False) as f:
        fut: Future = Future()
        got = io.engine.submit_read(f, 0, memoryview(bytearray(0)), fut)
        assert got is fut and fut.result(5) == 0
        assert io.read_into(path, 4096, np.zeros(0, np.uint8)) == 0
        assert _pool_intact(io)


def test_libaio_io_submit_refusal_completes_the_future_and_gives_everything_back(disk_dir, make_data, monkeypatch):
    data = make_data(2 * BS, seed=5)
    path = disk_dir / "f.bin"
    try:
        io = AioHandle(AioConfig(engine="libaio", block_size=BS, queue_depth=2))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"libaio: {exc}")
    from aio.engines.libaio_engine import _raw

    with io:
        io.write_file(path, data)

        def refuse(ctx, n, iocbs):
            raise OSError(errno.EINVAL, "refused")

        monkeypatch.setattr(_raw, "io_submit", refuse)
        for i in range(10):
            with pytest.raises(AioError, match="io_submit"):
                io.read_into(path, 3 + i, np.zeros(BS, np.uint8))
        monkeypatch.undo()
        assert _pool_intact(io)
        assert io.engine._slots._value == io.engine.queue_depth  # noqa: SLF001
        dest = np.zeros(BS, np.uint8)
        io.read_into(path, 3, dest)
        assert dest.tobytes() == data[3 : 3 + BS].tobytes()


def test_libaio_reads_past_the_end_stop_at_the_end(disk_dir, make_data):
    """A read longer than the file: the short transfer is resubmitted, then 0 bytes mean the end."""
    engine, _ = _libaio()
    data = make_data(5000, seed=6)
    path = disk_dir / "f.bin"
    path.write_bytes(data.tobytes())
    buf = AlignedBuffer(3 * 4096, pin=False)
    try:
        with open_file(path, "r", direct=False) as f:
            fut: Future = Future()
            assert engine.submit_read(f, 0, buf.view(), fut).result(10) == 5000
            assert buf.view(5000).tobytes() == data.tobytes()
    finally:
        engine.close()


def test_submits_from_worker_threads_complete_and_return_all_blocks(disk_dir, make_data):
    """Off the main thread signals_held() does nothing; staged reads and writes still settle."""
    data = make_data(6 * BS + 123, seed=7)
    with AioHandle(AioConfig(block_size=BS, queue_depth=3)) as io:
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                p = disk_dir / f"t{i}.bin"
                io.write_file(p, data)
                dest = np.zeros(data.size - 7, np.uint8)
                io.read_into(p, 7, dest)
                assert dest.tobytes() == data[7:].tobytes()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert _pool_intact(io)
