"""Closing an idle libaio engine returns at once, and its kernel context still goes away.

Why: a one-shot command (``ucp verify``, ``ucp reshape``) closes its shared aio handle at exit, and the
engine's reaper sits in ``io_getevents`` polling every 50 ms; joining it made every such exit wait for
that poll (issue 21: nothing waits on threads that have no work left). With requests in flight close
still waits for them: their buffers must outlive the kernel's use of them.
"""

from __future__ import annotations

import time

import pytest

import aio.files
from aio import AioConfig
from aio.engines import create_engine


def _libaio_engine():
    ok, why = aio.libaio_status()
    if not ok:
        pytest.skip(f"libaio unavailable: {why}")
    return create_engine(AioConfig(engine="libaio", queue_depth=2))


def test_idle_engine_closes_without_waiting_for_the_reapers_poll(disk_dir) -> None:
    path = disk_dir / "f.bin"
    path.write_bytes(b"x" * 8192)
    took = []
    for _ in range(3):
        eng = _libaio_engine()
        with aio.files.open_file(path, "r", direct=False) as f:
            buf = bytearray(4096)
            assert eng.submit_read(f, 0, memoryview(buf)).result(timeout=10) == 4096
        assert bytes(buf) == b"x" * 4096
        time.sleep(0.005)  # the reaper is back in its 50 ms io_getevents
        t0 = time.perf_counter()
        eng.close()
        took.append(time.perf_counter() - t0)
        reaper = eng._reaper  # noqa: SLF001 - what close used to join
        reaper.join(timeout=5)
        assert not reaper.is_alive()  # it ended by itself (and destroyed the context: it was its to destroy)
        with pytest.raises(ValueError, match="closed LibaioEngine"):
            with aio.files.open_file(path, "r", direct=False) as f:
                eng.submit_read(f, 0, memoryview(bytearray(4096)))
    assert min(took) < 0.02, took  # joining the reaper took 40-50 ms


def test_close_with_a_request_in_flight_waits_for_it(disk_dir, monkeypatch) -> None:
    path = disk_dir / "f.bin"
    path.write_bytes(b"y" * 8192)
    eng = _libaio_engine()
    real = eng._complete  # noqa: SLF001

    def slow(req, res):  # the completion arrives while close is running
        time.sleep(0.2)
        real(req, res)

    monkeypatch.setattr(eng, "_complete", slow)
    with aio.files.open_file(path, "r", direct=False) as f:
        buf = bytearray(4096)
        fut = eng.submit_read(f, 0, memoryview(buf))
        time.sleep(0.05)  # reaped, completing slowly: no longer in the kernel, but not done either
        eng.close()
        assert fut.done() and fut.result() == 4096 and bytes(buf) == b"y" * 4096
    assert not eng._reaper.is_alive()  # noqa: SLF001 - joined: it destroyed nothing, close did
    assert not getattr(eng, "_reaper_destroys", False)
