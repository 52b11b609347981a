"""The planned read path (aio.scatter + AioHandle._read_all): bytes land exactly in the
caller's memory and nowhere else, for adversarial layouts, every vector length, buffered and O_DIRECT files,
partial completions, errors and Ctrl-C part way through."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import aio.engines.base as engine_base
import aio.engines.libaio_engine as libaio_engine
from aio import AioConfig, AioError, AioHandle, AlignedBuffer, ThreadEngine, libaio_status
from aio.buffers import BufferPool, round_up
from aio.engines.base import IOV_MAX, Engine, pread_full, pwrite_full, rest_of
from aio.prefetch import forget, prefetch_files
from aio.scatter import MAX_GAP, MIN_DIRECT

KIB, MIB = 1 << 10, 1 << 20
A = 4096
GUARD = 0xEE
SIZE = 3 * MIB + 1234  # not a multiple of the alignment


# -- helpers ----------------------------------------------------------------------------------------------


def _write(directory: Path, size: int = SIZE, seed: int = 0) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    path = directory / f"data-{size}-{seed}.bin"
    path.write_bytes(data.tobytes())
    return path, data


class _Arena:
    """Destinations in one guard-filled buffer. ``(offset, n, where)``: ``where`` is ``"in"`` (address in phase
    with ``offset``, after a guard page), ``"out"`` (out of phase by ``1000``, after a guard page), ``"adj"``
    (right after the previous destination, sharing its page) or ``"adj1"`` (one guard byte after it).
    ``skew`` moves every destination that many bytes more (512: "in" stays in phase only mod 512)."""

    def __init__(self, specs: list[tuple[int, int, str]], *, skew: int = 0) -> None:
        self.buf = AlignedBuffer(sum(round_up(n, A) + 3 * A for _, n, _ in specs) + A, pin=False)
        self.mem = self.buf.numpy()
        self.mem[:] = GUARD
        self.ranges: list[tuple[int, memoryview]] = []
        self.spans: list[tuple[int, int]] = []  # (start in buf, length)
        prev_end = A
        for offset, n, where in specs:
            if where in ("in", "out"):
                start = round_up(prev_end, A) + A + (offset + skew + (1000 if where == "out" else 0)) % A
            else:
                start = prev_end + (where == "adj1")
            assert start + n <= self.buf.capacity
            self.ranges.append((offset, self.buf.view(n, start)))
            self.spans.append((start, n))
            prev_end = max(prev_end, start + n)

    def outside_untouched(self) -> None:
        mask = np.ones(self.mem.size, bool)
        for start, n in self.spans:
            mask[start : start + n] = False
        bad = np.flatnonzero(self.mem[mask] != GUARD)
        assert bad.size == 0, f"{bad.size} bytes written outside the destinations"

    def check(self, data: np.ndarray) -> None:
        for (offset, _), (start, n) in zip(self.ranges, self.spans):
            got = self.mem[start : start + n]
            want = data[offset : offset + n]
            if not np.array_equal(got, want):
                first = int(np.flatnonzero(got != want)[0])
                pytest.fail(f"range at file offset {offset} (+{n}, memory {start}): first wrong byte at +{first}")
        self.outside_untouched()


def _read_and_check(io: AioHandle, path: Path, specs: list, data: np.ndarray) -> None:
    """One ``read_ranges`` call into a fresh arena of ``specs``; every range must hold the file's bytes."""
    arena = _Arena(specs)
    io.read_ranges(path, arena.ranges)
    arena.check(data)


def _pool_settles(io: AioHandle, timeout: float = 2.0) -> bool:
    """Every staging block back in the pool, each once (given a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        free = list(io.pool._free)  # noqa: SLF001
        if len(free) == io.pool._created and len({id(b) for b in free}) == len(free):  # noqa: SLF001
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _spy_vectors(io: AioHandle, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the vector length of every read the handle submits."""
    lengths: list[int] = []
    one, many = io.engine.submit_read, io.engine.submit_readv

    def spy_one(f, offset, buf, future=None):
        lengths.append(1)
        return one(f, offset, buf, future)

    def spy_many(f, offset, buffers, future=None):
        lengths.append(len(buffers))
        return many(f, offset, buffers, future)

    monkeypatch.setattr(io.engine, "submit_read", spy_one)
    monkeypatch.setattr(io.engine, "submit_readv", spy_many)
    return lengths


def _handle(engine: str, **kw) -> AioHandle:
    return AioHandle(AioConfig(engine=engine, queue_depth=kw.pop("queue_depth", 4), **kw))


def _layouts(size: int) -> dict[str, list[tuple[int, int, str]]]:
    """Named adversarial layouts of ``(file offset, length, where)`` for a file of ``size`` bytes."""
    g = 70 * KIB
    gaps, pos = [], 64
    for i, gap in enumerate([MAX_GAP - 1, MAX_GAP, MAX_GAP + 1, MAX_GAP - A, MAX_GAP + A, 1, A - 1, A, A + 1]):
        gaps.append((pos, g, "in" if i % 2 else "out"))
        pos += g + gap
    gaps.append((pos, 10, "in"))
    assert pos < size
    return {
        "touching_out_of_phase": [
            (100, 5000, "out"),
            (5100, 3000, "adj"),
            (8100, 10, "adj1"),
            (8110, 70000, "out"),
            (78110, 3, "adj"),
        ],
        "touching_in_phase_large": [
            (64, 200 * KIB, "in"),
            (64 + 200 * KIB, 300 * KIB, "in"),
            (64 + 500 * KIB, 5, "adj"),
            (64 + 500 * KIB + 5, 130 * KIB, "adj1"),
        ],
        "in_phase_then_adjacent_memory": [
            (64, 200 * KIB, "in"),
            (64 + 200 * KIB, 300 * KIB, "adj"),
            (64 + 500 * KIB, 300 * KIB, "adj"),
        ],
        "tiny_ranges_sharing_pages": [
            (10, 1, "out"),
            (11, 1, "adj"),
            (4000, 96, "in"),
            (4096, 1, "adj1"),
            (4097, 4095, "out"),
            (8191, 2, "out"),
            (8193, 1, "adj"),
            (12287, 1, "in"),
            (12288, 1, "in"),
        ],
        "overlapping": [
            (0, 100 * KIB, "in"),
            (50 * KIB, 100 * KIB, "in"),
            (50 * KIB, 100 * KIB, "out"),
            (0, 1, "out"),
            (150 * KIB - 1, 1, "out"),
            (0, 150 * KIB, "adj"),
            (60 * KIB + 3, 7, "adj1"),
            (100 * KIB, 100 * KIB, "in"),
        ],
        "gaps_around_max_gap": gaps,
        "ends_at_end_of_file": [
            (size - 5000, 5000, "out"),
            (size - 70000 - 1, 70000, "in"),
            (size - 1, 1, "out"),
            (size - 200 * KIB, 200 * KIB, "in"),
        ],
        "whole_file_in_phase": [(0, size, "in")],
        "whole_file_out_of_phase": [(1, size - 1, "out")],
        "across_blocks_in_phase": [
            (3 * A + 7, 900 * KIB, "in"),
            (3 * A + 7 + 900 * KIB, 1100 * KIB, "in"),
            (3 * A + 7 + 2000 * KIB, 4, "in"),
        ],
        "min_direct_edges": [
            (A - 10, 10 + MIN_DIRECT + 10, "in"),
            (2 * MIB, MIN_DIRECT, "in"),
            (2 * MIB + MIN_DIRECT, MIN_DIRECT - A, "in"),
            (2 * MIB + 2 * MIN_DIRECT, A, "in"),
        ],
        "aligned_direct_only": [(0, 128 * KIB, "in"), (128 * KIB, 128 * KIB, "in"), (MIB, 64 * KIB, "in")],
        "given_out_of_order": [
            (MIB + 5, 100 * KIB, "in"),
            (7, 50, "out"),
            (MIB, 5, "adj"),
            (0, 7, "out"),
            (300 * KIB, 300 * KIB, "out"),
            (57, 200 * KIB, "in"),
        ],
        "empty_ranges_mixed_in": [(5, 0, "out"), (5, 10, "in"), (size, 0, "in"), (A, 0, "adj")],
    }


# -- bytes land exactly, nowhere else ------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [A, 64 * KIB, MIB])
@pytest.mark.parametrize("max_segments", [None, 1, 2])
def test_adversarial_layouts_land_exactly_and_nowhere_else(
    disk_dir: Path, engine: str, block_size: int, max_segments: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = _write(disk_dir)
    with _handle(engine, block_size=block_size) as io:
        if max_segments is not None:
            monkeypatch.setattr(io.engine, "max_segments", max_segments)
        vectors = _spy_vectors(io, monkeypatch)
        for name, specs in _layouts(data.size).items():
            arena = _Arena(specs)
            io.read_ranges(path, arena.ranges)
            try:
                arena.check(data)
            except AssertionError as exc:
                raise AssertionError(f"layout {name}: {exc}") from None
        assert vectors and max(vectors) <= (max_segments or IOV_MAX)
        assert _pool_settles(io)
        # each range alone, through read_into, fills the same bytes
        arena = _Arena(_layouts(data.size)["overlapping"] + _layouts(data.size)["ends_at_end_of_file"])
        for offset, view in arena.ranges:
            assert io.read_into(path, offset, view) == view.nbytes
        arena.check(data)


def _random_specs(rng: np.random.Generator, size: int) -> list[tuple[int, int, str]]:
    specs, pos = [], int(rng.integers(0, 3 * A))
    for _ in range(int(rng.integers(1, 14))):
        n = int(rng.choice([rng.integers(1, 3 * A), rng.integers(1, 400 * KIB), rng.integers(MIN_DIRECT, 200 * KIB)]))
        n = min(n, size - pos)
        if n <= 0:
            break
        specs.append((pos, n, str(rng.choice(["in", "in", "out", "adj", "adj1"]))))
        step = rng.choice([n, int(rng.integers(0, n + 1)), n + int(rng.integers(0, MAX_GAP + 3 * A))])
        pos += int(step)
        if pos >= size:
            break
    return specs


@pytest.mark.parametrize("direct", [True, False])
def test_random_layouts_land_exactly_and_nowhere_else(
    disk_dir: Path, engine: str, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = _write(disk_dir, 2 * MIB + 77, seed=3)
    rng = np.random.default_rng(5 if direct else 6)
    handles = {bs: _handle(engine, block_size=bs, use_direct=direct) for bs in (A, 16 * KIB, 256 * KIB, MIB)}
    try:
        for _ in range(30):
            io = handles[int(rng.choice(list(handles)))]
            monkeypatch.setattr(io.engine, "max_segments", int(rng.choice([1, 2, 3, IOV_MAX])))
            arena = _Arena(_random_specs(rng, data.size))
            io.read_ranges(path, [(o, v) for o, v in reversed(arena.ranges)])
            arena.check(data)
        assert all(_pool_settles(io) for io in handles.values())
    finally:
        for io in handles.values():
            io.close()


def test_files_on_tmpfs_land_exactly(shm_dir: Path, engine: str) -> None:
    path, data = _write(shm_dir, SIZE, seed=8)
    for direct in (True, False):
        with _handle(engine, block_size=64 * KIB, use_direct=direct) as io:
            for specs in _layouts(data.size).values():
                _read_and_check(io, path, specs, data)
            assert _pool_settles(io)


def test_warm_files_are_read_buffered_straight_into_memory(
    disk_dir: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetched file is read buffered (align 1): every range lands straight in its memory, no staging,
    and many tiny touching ranges are cut into vectors the engine takes."""
    path, data = _write(disk_dir, SIZE, seed=9)
    prefetch_files(path, max_bytes=1 << 30).wait(30)
    try:
        with _handle(engine, block_size=256 * KIB) as io:
            assert not io._read_direct(path)  # noqa: SLF001
            vectors = _spy_vectors(io, monkeypatch)
            for specs in _layouts(data.size).values():
                _read_and_check(io, path, specs, data)
            tiny = [(100 + 3 * i, 1 + i % 3, "adj1") for i in range(2500)]  # 2500 buffers: > IOV_MAX
            arena = _Arena(tiny)
            vectors.clear()
            io.read_ranges(path, arena.ranges)
            arena.check(data)
            assert max(vectors) <= IOV_MAX and sum(vectors) == 2500
            assert io.pool._created == 0  # noqa: SLF001 - nothing staged
    finally:
        forget(path)


def test_o_direct_vectors_at_the_kernel_limit(disk_dir: Path, engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """600 touching in-phase ranges with direct middles in one 64 MiB block: about 1200 segments, cut at
    IOV_MAX (the kernel's UIO_MAXIOV for preadv and IOCB_CMD_PREADV) into vectors the kernel takes."""
    n = MIN_DIRECT + A + 100
    specs = [(64 + i * n, n, "in") for i in range(600)]
    path, data = _write(disk_dir, 64 + 600 * n + 10, seed=23)
    with _handle(engine, block_size=64 * MIB, queue_depth=2) as io:
        vectors = _spy_vectors(io, monkeypatch)
        arena = _Arena(specs)
        io.read_ranges(path, arena.ranges)
        arena.check(data)
        assert max(vectors) == IOV_MAX and sum(vectors) > IOV_MAX
        assert _pool_settles(io)


def test_tiny_touching_ranges_share_pages_through_staging(disk_dir: Path, engine: str) -> None:
    """2500 ranges of 1..3 bytes, each in its own memory: a page read once serves many ranges."""
    path, data = _write(disk_dir, 64 * KIB + 5, seed=10)
    specs = [(100 + 3 * i, 1 + i % 3, "adj1") for i in range(2500)] + [(64 * KIB + 4, 1, "adj")]
    for block_size in (A, 64 * KIB):
        with _handle(engine, block_size=block_size) as io:
            _read_and_check(io, path, specs, data)
            assert _pool_settles(io)


def test_alignment_512_reads_memory_in_phase_mod_512_straight(
    disk_dir: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """alignment=512 (the disk's logical block here): memory in phase mod 512 only is read straight into."""
    path, data = _write(disk_dir, SIZE, seed=17)
    probe = AlignedBuffer(2 * A, pin=False)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        os.preadv(fd, [probe.view(512, 512)], 512)
    except OSError:
        pytest.skip("the disk here needs more than 512-byte alignment for O_DIRECT")
    finally:
        os.close(fd)
    with _handle(engine, block_size=64 * KIB, alignment=512) as io:
        for max_segments in (1, 2, IOV_MAX):
            monkeypatch.setattr(io.engine, "max_segments", max_segments)
            for specs in _layouts(data.size).values():
                arena = _Arena(specs, skew=512)
                io.read_ranges(path, arena.ranges)
                arena.check(data)
        assert _pool_settles(io)


def test_threads_sharing_one_handle_with_a_tiny_pool(disk_dir: Path, engine: str) -> None:
    """Four threads read random layouts through one handle whose pool has 3 blocks (queue_depth 1):
    no deadlock, every byte exact, every block back once."""
    path, data = _write(disk_dir, 2 * MIB + 77, seed=20)
    errors: list[BaseException] = []
    with _handle(engine, block_size=16 * KIB, queue_depth=1) as io:

        def work(seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                for _ in range(6):
                    arena = _Arena(_random_specs(rng, data.size))
                    io.read_ranges(path, arena.ranges)
                    arena.check(data)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "deadlocked"
        assert not errors, errors[0]
        assert _pool_settles(io) and io.pool._created <= io.pool.max_buffers  # noqa: SLF001


class _InlineEngine(Engine):
    """Completes every request inside its submit, in the caller's thread (a synchronous engine): the copy-out
    and the block's release then run before the next request is planned into a block."""

    name = "inline"

    def __init__(self, max_segments: int) -> None:
        self.max_segments = max_segments
        self.most = 0

    def _run(self, move, f, offset, buf, future):
        future = future or Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(move(f, offset, buf))
        except Exception as exc:  # noqa: BLE001
            future.set_exception(exc)
        return future

    def submit_read(self, f, offset, buf, future=None):
        return self._run(pread_full, f, offset, buf, future)

    def submit_readv(self, f, offset, buffers, future=None):
        assert 1 < len(buffers) <= self.max_segments
        self.most = max(self.most, len(buffers))
        return self._run(pread_full, f, offset, list(buffers), future)

    def submit_write(self, f, offset, buf, future=None):
        return self._run(pwrite_full, f, offset, buf, future)


@pytest.mark.parametrize("max_segments", [1, 3])
def test_an_engine_completing_inside_submit(disk_dir: Path, max_segments: int) -> None:
    path, data = _write(disk_dir, SIZE, seed=24)
    engine = _InlineEngine(max_segments)
    with AioHandle(AioConfig(block_size=64 * KIB, queue_depth=1), engine=engine) as io:
        for specs in _layouts(data.size).values():
            arena = _Arena(specs)
            io.read_ranges(path, arena.ranges)
            arena.check(data)
        arena = _Arena([(0, 5000, "out"), (SIZE - 10, 11, "out")])
        with pytest.raises(AioError, match=path.name):
            io.read_ranges(path, arena.ranges)
        arena.outside_untouched()
        assert len(io.pool._free) == io.pool._created <= 1  # noqa: SLF001 - one block, reused throughout
    assert engine.most == (3 if max_segments == 3 else 0)


# -- the end of the file ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("where", ["in", "out"])
@pytest.mark.parametrize("block_size", [A, MIB])
def test_a_range_one_byte_past_the_end_raises_naming_the_file_and_writes_nothing_outside(
    disk_dir: Path, engine: str, direct: bool, where: str, block_size: int
) -> None:
    for size in (SIZE, MIB):  # the aligned size: a direct-only request (no staging) reads past the end
        path, data = _write(disk_dir, size, seed=11)
        with _handle(engine, block_size=block_size, use_direct=direct) as io:
            good = [(0, 5000, "out"), (MIB // 2, 100 * KIB, "in")]
            bad_ranges = [
                (0, size + 1),
                (size - 1, 2),
                (size - 100 * KIB, 100 * KIB + 1),
                (size, 1),
                (size + A, A),
                (size, 128 * KIB),
                (size - 64 * KIB, 128 * KIB),
            ]  # (in phase, MIB: direct only)
            for bad in bad_ranges:
                arena = _Arena(good + [(bad[0], bad[1], where)])
                with pytest.raises(AioError) as info:
                    io.read_ranges(path, arena.ranges)
                assert info.value.filename == str(path) and str(path) in str(info.value)
                assert info.value.errno == errno.ENODATA
                arena.outside_untouched()
                assert _pool_settles(io)
            arena = _Arena(good + [(size - 100 * KIB, 100 * KIB, where)])  # exactly to the end: fine
            io.read_ranges(path, arena.ranges)
            arena.check(data)


@pytest.mark.parametrize("direct", [True, False])
def test_a_file_that_shrinks_before_a_vectored_read_is_an_error_not_stale_bytes(
    disk_dir: Path, engine: str, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is cut short just before the first read goes out (single or vectored): the call must fail
    with ENODATA naming the file, never fill a range from a staging block's old bytes."""
    path, data = _write(disk_dir, SIZE, seed=18)
    with _handle(engine, block_size=MIB, use_direct=direct) as io:
        other, _ = _write(disk_dir, SIZE, seed=99)
        dirty = _Arena([(1, 3 * MIB, "out")])  # leaves the pool's blocks full of another file's bytes
        io.read_ranges(other, dirty.ranges)
        for cut_to in (2 * MIB + 100, 2 * MIB + 128 * KIB + 1):
            path.write_bytes(data.tobytes())
            one, many = io.engine.submit_read, io.engine.submit_readv
            cut: list[int] = []  # the first submit of either kind truncates the file

            def cutting(real: Callable[..., Any], size: int, done: list[int]) -> Callable[..., Any]:
                def submit(f, at, buf, future=None):
                    if not done:
                        os.truncate(path, size)
                        done.append(1)
                    return real(f, at, buf, future)

                return submit

            monkeypatch.setattr(io.engine, "submit_read", cutting(one, cut_to, cut))
            monkeypatch.setattr(io.engine, "submit_readv", cutting(many, cut_to, cut))
            arena = _Arena(
                [
                    (64, MIB, "in"),
                    (MIB + 64 + 100, MIB, "out"),
                    (2 * MIB + 128 * KIB, 50, "out"),
                    (2 * MIB + 200 * KIB, 300 * KIB, "in"),
                ]
            )
            with pytest.raises(AioError) as info:
                io.read_ranges(path, arena.ranges)
            monkeypatch.setattr(io.engine, "submit_read", one)
            monkeypatch.setattr(io.engine, "submit_readv", many)
            assert info.value.errno == errno.ENODATA and info.value.filename == str(path)
            arena.outside_untouched()
            # every byte of every range is the file's, untouched, or (memory read straight into past the new
            # end: O_DIRECT zero-fills it) zero; never a staging block's old bytes
            for (offset, _), (start, n) in zip(arena.ranges, arena.spans):
                got, want = arena.mem[start : start + n], data[offset : offset + n]
                assert ((got == want) | (got == GUARD) | (got == 0)).all(), f"stale bytes in the range at {offset}"
            assert _pool_settles(io)


# -- partial completions -----------------------------------------------------------------------------------


def test_threads_engine_short_preadv_resumes_at_the_right_buffer(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """os.preadv moving fewer bytes than asked (as a signal or a slow device can make it): the remainder
    continues in the right buffer at the right place, for aligned and unaligned short counts."""
    path, data = _write(disk_dir, SIZE, seed=12)
    real = os.preadv
    calls = [0]

    def short_preadv(fd, buffers, offset, *flags):
        calls[0] += 1
        return real(fd, engine_base._at_most(list(buffers), chunk), offset, *flags)  # noqa: SLF001

    for direct, chunk in ((True, A), (True, 3 * A), (False, 1000), (False, 1)):
        with _handle("threads", block_size=256 * KIB, use_direct=direct) as io:
            monkeypatch.setattr(engine_base.os, "preadv", short_preadv)
            try:
                specs = _layouts(SIZE)
                for name in (
                    "touching_in_phase_large",
                    "overlapping",
                    "ends_at_end_of_file",
                    "tiny_ranges_sharing_pages",
                    "min_direct_edges",
                ):
                    if chunk == 1 and name == "touching_in_phase_large":
                        continue  # a byte a call: keep it short
                    arena = _Arena(specs[name])
                    io.read_ranges(path, arena.ranges)
                    arena.check(data)
            finally:
                monkeypatch.setattr(engine_base.os, "preadv", real)
            assert _pool_settles(io)
    assert calls[0] > 100


def test_libaio_partial_completions_resubmit_the_rest_of_the_vector(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each (re)submission moves at most ``chunk`` bytes (the vector cut short, as a short completion leaves
    it): the engine's resubmissions of ``rest_of(req.buffers, req.done)`` must fill every buffer exactly."""
    ok, why = libaio_status()
    if not ok:
        pytest.skip(why)
    path, data = _write(disk_dir, SIZE, seed=13)
    submits = [0]

    def cutting_at(chunk: int) -> Callable[..., Any]:
        def cut_rest_of(buffers, done):
            submits[0] += 1
            return engine_base._at_most(rest_of(buffers, done), chunk)  # noqa: SLF001

        return cut_rest_of

    for direct, chunk in ((True, A), (True, 5 * A), (False, 777)):
        with _handle("libaio", block_size=256 * KIB, use_direct=direct) as io:
            monkeypatch.setattr(libaio_engine, "rest_of", cutting_at(chunk))
            try:
                specs = _layouts(SIZE)
                for name in (
                    "touching_in_phase_large",
                    "overlapping",
                    "ends_at_end_of_file",
                    "tiny_ranges_sharing_pages",
                    "min_direct_edges",
                    "gaps_around_max_gap",
                ):
                    arena = _Arena(specs[name])
                    io.read_ranges(path, arena.ranges)
                    arena.check(data)
                arena = _Arena([(SIZE - 3000, 3001, "out")])  # and the end of the file still ends it
                with pytest.raises(AioError, match=path.name):
                    io.read_ranges(path, arena.ranges)
                arena.outside_untouched()
            finally:
                monkeypatch.undo()
            assert _pool_settles(io)
    assert submits[0] > 200


# -- errors and Ctrl-C part way through ---------------------------------------------------------------------


class _Scripted(ThreadEngine):
    """Reads (single and vectored) held by ``gate``; submit number ``fail_at`` raises ``exc``, either before the
    engine takes it ("before") or after ("after"), or its read fails with ``exc`` on the device ("device")."""

    def __init__(self, fail_at: int, how: str, exc: BaseException, max_segments: int = IOV_MAX) -> None:
        super().__init__(2)
        self.fail_at, self.how, self.exc = fail_at, how, exc
        self.max_segments = max_segments
        self.gate = threading.Event()
        self.taken: list[Future] = []
        self.submits = 0
        self.spans: list[tuple[int, int]] = []  # (file offset, bytes) of each request taken

    def submit_read(self, f, offset, buf, future=None):
        return self._go(f, offset, [buf], future)

    def submit_readv(self, f, offset, buffers, future=None):
        return self._go(f, offset, list(buffers), future)

    def _go(self, f, offset, buffers, future):
        k, self.submits = self.submits, self.submits + 1
        if k == self.fail_at and self.how == "before":
            threading.Timer(0.3, self.gate.set).start()
            raise self.exc

        def run(f, offset, buffers) -> int:
            self.gate.wait(10)
            if k == self.fail_at and self.how == "device":
                raise self.exc
            return pread_full(f, offset, buffers)

        fut = self._start(run, f, offset, buffers, future or Future())
        self.taken.append(fut)
        self.spans.append((offset, sum(b.nbytes for b in buffers)))
        if k == self.fail_at and self.how == "after":
            threading.Timer(0.3, self.gate.set).start()
            raise self.exc
        if k == self.fail_at and self.how == "device":
            threading.Timer(0.3, self.gate.set).start()
        return fut


_MANY = [(i * 300 * KIB + 17, 200 * KIB + 5, "in" if i % 2 else "out") for i in range(8)]  # ~10 requests of 256 KiB


@pytest.mark.parametrize("how", ["before", "after", "device"])
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("max_segments", [1, IOV_MAX])
def test_a_failure_part_way_leaves_nothing_in_flight_and_every_block_back(
    disk_dir: Path, how: str, exc_type: type, max_segments: int
) -> None:
    path, data = _write(disk_dir, SIZE, seed=14)
    exc = KeyboardInterrupt() if exc_type is KeyboardInterrupt else AioError(errno.EIO, str(path), 0, "injected")
    engine = _Scripted(3, how, exc, max_segments)
    with AioHandle(AioConfig(block_size=256 * KIB, queue_depth=8), engine=engine) as io:
        arena = _Arena(_MANY)
        try:
            with pytest.raises(exc_type):
                io.read_ranges(path, arena.ranges)
            assert all(f.done() for f in engine.taken), "raised while a read still writes into the caller's memory"
            snapshot = arena.mem.copy()
        finally:
            engine.gate.set()
        time.sleep(0.2)
        assert np.array_equal(snapshot, arena.mem), "caller memory changed after the call raised"
        arena.outside_untouched()
        assert _pool_settles(io)
        if how == "device":  # every request was submitted and taken
            assert engine.submits == len(engine.taken) > 3
        engine.fail_at = -1
        arena = _Arena(_MANY)
        io.read_ranges(path, arena.ranges)  # the handle is usable afterwards
        arena.check(data)
        assert _pool_settles(io)


def test_ctrl_c_while_waiting_for_a_staging_block_waits_for_the_reads_in_flight(disk_dir: Path) -> None:
    """queue_depth 1: a pool of 3 blocks, all held by gated reads; the 4th request waits for a block when
    Ctrl-C comes. The call must raise only once the 3 reads in flight have completed (and copied out)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread (signals)")
    path, data = _write(disk_dir, SIZE, seed=15)
    engine = _Scripted(-1, "none", KeyboardInterrupt())
    main = threading.main_thread().ident
    assert main is not None

    def ctrl_c_then_open() -> None:
        while engine.submits < 3:
            time.sleep(0.01)
        time.sleep(0.2)  # the main thread now waits in _take for a 4th block
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.3)
        engine.gate.set()

    with AioHandle(AioConfig(block_size=256 * KIB, queue_depth=1), engine=engine) as io:
        arena = _Arena(_MANY)
        t = threading.Thread(target=ctrl_c_then_open)
        t.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                io.read_ranges(path, arena.ranges)
            assert engine.submits == 3
            assert all(f.done() for f in engine.taken)
            snapshot = arena.mem.copy()
        finally:
            engine.gate.set()
            t.join()
        time.sleep(0.2)
        assert np.array_equal(snapshot, arena.mem)
        arena.outside_untouched()
        covered = np.zeros(SIZE + A, bool)
        for o, n in engine.spans:
            covered[o : o + n] = True
        whole = [(o, s, n) for (o, _), (s, n) in zip(arena.ranges, arena.spans) if covered[o : o + n].all()]
        assert whole, "no range was read before the interrupt"
        for offset, start, n in whole:  # the ranges the completed reads cover were copied out
            assert np.array_equal(arena.mem[start : start + n], data[offset : offset + n])
        assert _pool_settles(io)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # a SIGINT landing in a finalizer
def test_ctrl_c_at_random_moments_of_a_real_read(disk_dir: Path, engine: str) -> None:
    """A terminal's Ctrl-C (SIGINT to the process) at random moments of a many-request read on the real
    engines: whenever the KeyboardInterrupt comes, nothing writes into the caller's memory afterwards,
    every block and engine slot is back, and the handle reads exactly afterwards."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread (signals)")
    path, data = _write(disk_dir, 8 * MIB + 5, seed=21)
    specs = [(i * 97 * KIB + i, 90 * KIB + i, "in" if i % 3 else "out") for i in range(84)]
    rng = np.random.default_rng(22)
    interrupted = 0
    with _handle(engine, block_size=64 * KIB, queue_depth=4) as io:
        for _ in range(25):
            arena = _Arena(specs)
            delay = float(rng.uniform(0, 0.04))
            sender = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
            try:
                sender.start()
                io.read_ranges(path, arena.ranges)
                sender.join()
                time.sleep(0.02)  # a signal sent after the read lands here
            except KeyboardInterrupt:
                interrupted += 1
                sender.join()
            snapshot = arena.mem.copy()
            time.sleep(0.05)
            assert np.array_equal(snapshot, arena.mem), "caller memory changed after the call ended"
            arena.outside_untouched()
            assert _pool_settles(io)
            if engine == "libaio":
                assert isinstance(io.engine, libaio_engine.LibaioEngine)
                assert not io.engine._inflight and io.engine._slots._value == io.engine.queue_depth  # noqa: SLF001
        arena = _Arena(specs)
        io.read_ranges(path, arena.ranges)
        arena.check(data)
    assert interrupted


# -- the order of "done" and "block back" ------------------------------------------------------------------


class _SlowRelease(BufferPool):
    """A pool whose releases from engine threads are slow (a busy machine preempting the engine thread
    between completing a request and giving its block back)."""

    def release(self, buf: AlignedBuffer) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        super().release(buf)


def test_a_read_returns_only_once_its_staging_blocks_are_back(disk_dir: Path) -> None:
    path, data = _write(disk_dir, 64 * KIB, seed=16)
    with AioHandle(AioConfig(engine="threads", block_size=64 * KIB, queue_depth=2)) as io:
        io.pool.__class__ = _SlowRelease
        dest = np.zeros(1000, np.uint8)
        io.read_into(path, 5, dest)  # unaligned: staged
        assert dest.tobytes() == data[5:1005].tobytes()
        assert len(io.pool._free) == io.pool._created  # noqa: SLF001


def test_a_closed_writer_has_given_its_staging_blocks_back(disk_dir: Path) -> None:
    """The same order for writes: close() returns once every block its writes staged through is back."""
    with AioHandle(AioConfig(engine="threads", block_size=64 * KIB, queue_depth=2)) as io:
        io.pool.__class__ = _SlowRelease
        data = bytes(range(256)) * 1000  # read-only bytes: staged, in 4 blocks
        with io.writer(disk_dir / "w.bin") as w:
            w.write(data)
        assert len(io.pool._free) == io.pool._created  # noqa: SLF001
    assert (disk_dir / "w.bin").read_bytes() == data


@pytest.mark.parametrize("where", ["staged", "direct"])
def test_a_failed_read_releases_the_callers_buffer(disk_dir: Path, engine: str, where: str) -> None:
    """After a read fails (file too short) and the caller dropped the error, nothing may still export the
    caller's memory: ucp.store.reader.MemoryPool reuses an arena only when ``mmap.resize`` finds no export, and
    a bytearray destination cannot grow while one lives."""
    import gc
    import mmap

    path, _ = _write(disk_dir, MIB, seed=19)
    m = mmap.mmap(-1, 4 * MIB)
    offset, n = (5, MIB) if where == "staged" else (0, MIB + A)
    gc.disable()
    try:
        with _handle(engine, block_size=256 * KIB) as io:
            try:
                io.read_into(path, offset, memoryview(m)[:n])
            except AioError:
                pass
            else:
                pytest.fail("the read past the end did not fail")
            m.resize(len(m))  # BufferError while an export of ``m`` is alive
    finally:
        gc.enable()
        gc.collect()
