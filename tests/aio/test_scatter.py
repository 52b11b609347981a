"""Reads of many ranges planned as few large aligned requests (aio.scatter), and the handle that runs them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aio import AioConfig, AioError, AioHandle, AlignedBuffer
from aio.buffers import address_of
from aio.scatter import MAX_GAP, ReadRequest, disjoint_runs, plan_reads

KIB, MIB = 1 << 10, 1 << 20
ALIGN = 4096


def _simulate(file: np.ndarray, requests: list[ReadRequest]) -> None:
    """Run the plan against an in-memory 'file' as the kernel would: each request fills its vector
    from its offset (fewer bytes at the end of the file), then its staged bytes are copied out."""
    for req in requests:
        staging = np.zeros(req.staged, np.uint8)
        got, pos = 0, req.offset
        for buf in req.buffers(staging.data):
            chunk = file[pos : pos + buf.nbytes]
            np.frombuffer(buf, np.uint8)[: chunk.size] = chunk
            got += chunk.size
            pos += buf.nbytes
        assert got >= req.need, "a plan wanted bytes past the end of the file"
        for at, dest in req.copies:
            dest[:] = staging.data[at : at + dest.nbytes]


def _check_shape(requests: list[ReadRequest], *, align: int, block_size: int, max_segments: int) -> None:
    for req in requests:
        assert req.offset % align == 0 and req.length % align == 0 and 0 < req.length <= block_size
        assert 1 <= len(req.segments) <= max_segments
        assert sum(s.length for s in req.segments) == req.length
        assert req.staged == sum(s.length for s in req.segments if s.dest is None) <= block_size
        for s in req.segments:
            if s.dest is not None:  # straight into the caller's memory: O_DIRECT's rules hold
                assert address_of(s.dest) % align == 0 and s.length % align == 0
        for at, dest in req.copies:
            assert 0 <= at and at + dest.nbytes <= req.staged


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """(file size, [(file offset, length, memory shift)]): ranges laid out like a save's pieces, with
    gaps, some overlapping, some out of phase with their memory."""
    ranges, pos = [], draw(st.integers(0, 3 * ALIGN))
    for _ in range(draw(st.integers(1, 12))):
        n = draw(st.one_of(st.integers(1, 3 * ALIGN), st.integers(1, 300 * KIB)))
        in_phase = draw(st.booleans())
        shift = pos % ALIGN if in_phase else draw(st.integers(0, ALIGN - 1))
        ranges.append((pos, n, shift))
        step = draw(st.one_of(st.just(n), st.integers(0, n + MAX_GAP + 2 * ALIGN)))  # 0..n: overlaps
        pos += step
    size = max(o + n for o, n, _ in ranges) + draw(st.integers(0, 2 * ALIGN))
    return size, ranges


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=_layouts(),
    block_kib=st.sampled_from([4, 8, 64, 1024]),
    max_segments=st.sampled_from([1, 2, 3, 1024]),
    buffered=st.booleans(),
)
def test_every_plan_fills_every_range_exactly(layout, block_kib: int, max_segments: int, buffered: bool) -> None:
    size, ranges = layout
    file = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    memory = AlignedBuffer(sum(n + 2 * ALIGN for _, n, _ in ranges) + ALIGN)
    memory.numpy()[:] = 0xEE
    views, at = [], 0
    for offset, n, shift in ranges:
        views.append((offset, memory.view(n, at + shift)))
        at += n + ALIGN + (-(n + ALIGN) % ALIGN)
    align = 1 if buffered else ALIGN
    requests = plan_reads(views, align=align, block_size=block_kib * KIB, max_segments=max_segments)
    _check_shape(requests, align=align, block_size=block_kib * KIB, max_segments=max_segments)
    _simulate(file, requests)
    for offset, view in views:
        assert bytes(view) == file[offset : offset + view.nbytes].tobytes(), f"range at {offset}"


def test_a_run_of_in_phase_ranges_becomes_block_sized_requests() -> None:
    """100 tensors of 1 MiB + 100 bytes whose memory sits 64 bytes past a page (malloc's), laid out in
    phase: read range by range that was 300 requests (head, middle, tail each); planned, 14 full blocks."""
    n, count = MIB + 100, 100
    memory = AlignedBuffer(count * (n + 2 * ALIGN))
    views: list[tuple[int, memoryview]] = []
    offset, at = 64, 64
    for _ in range(count):
        views.append((offset, memory.view(n, at)))
        offset += n + (-(offset + n - 64) % ALIGN)  # the next piece in phase with its memory, as a save pads
        at += n + (-(at + n - 64) % ALIGN) + ALIGN
    requests = plan_reads(views, align=ALIGN, block_size=8 * MIB, max_segments=1024)
    span = views[-1][0] + n - 0
    assert len(requests) == -(-span // (8 * MIB))
    assert sum(r.length for r in requests) <= span + ALIGN  # every page read once: boundary pages are shared
    one_by_one = plan_reads(views, align=ALIGN, block_size=8 * MIB, max_segments=1)
    assert len(one_by_one) <= 2 * count + 1  # without vectors: a middle each, one staged page per boundary


def test_gaps_up_to_max_gap_are_read_through_larger_ones_start_a_new_request() -> None:
    memory = AlignedBuffer(4 * MIB)
    near = [(0, memory.view(MIB)), (MIB + MAX_GAP, memory.view(MIB, 2 * MIB))]
    far = [(0, memory.view(MIB)), (MIB + MAX_GAP + ALIGN, memory.view(MIB, 2 * MIB))]
    assert len(plan_reads(near, align=ALIGN, block_size=8 * MIB, max_segments=1024)) == 1
    assert len(plan_reads(far, align=ALIGN, block_size=8 * MIB, max_segments=1024)) == 2
    assert len(plan_reads(near, align=1, block_size=8 * MIB, max_segments=1024)) == 2  # buffered: no staging


def test_overlapping_ranges_are_planned_in_separate_runs() -> None:
    memory = AlignedBuffer(MIB)
    a, b, c = memory.view(5000), memory.view(5000, 8192), memory.view(100, 20000)
    runs = disjoint_runs([(100, a), (0, b), (6000, c)])
    assert [[o for o, _ in run] for run in runs] == [[0, 6000], [100]]


def test_block_size_must_be_a_multiple_of_the_alignment() -> None:
    with pytest.raises(ValueError, match="multiple of the alignment"):
        plan_reads([(0, memoryview(bytearray(10)))], align=ALIGN, block_size=6000, max_segments=4)


# -- the handle running the plans ---------------------------------------------------------------------


def _tensor_like_ranges(rng: np.random.Generator, memory: AlignedBuffer, size: int) -> list[tuple[int, memoryview]]:
    """Consecutive ranges of the file into memory 64 bytes past a page, in phase (as a save writes them)."""
    views: list[tuple[int, memoryview]] = []
    offset, at = 64, 64
    while True:
        n = int(rng.integers(1, 3 * MIB))
        if offset + n > size or at + n > memory.capacity:
            return views
        views.append((offset, memory.view(n, at)))
        offset += n + (-(offset + n - 64) % ALIGN)
        at += n + (-(at + n - 64) % ALIGN) + ALIGN


def test_the_handle_reads_tensor_like_ranges_bit_exact_in_few_requests(
    disk_dir: Path, engine: str, make_data, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = make_data(40 * MIB, seed=9)
    path = disk_dir / "pieces.bin"
    path.write_bytes(data.tobytes())
    memory = AlignedBuffer(48 * MIB)
    views = _tensor_like_ranges(np.random.default_rng(1), memory, data.size)
    with AioHandle(AioConfig(engine=engine, block_size=4 * MIB, queue_depth=8)) as io:
        submits: list[int] = []
        for name in ("submit_read", "submit_readv"):
            original = getattr(io.engine, name)

            def spy(f, offset, buf, future=None, _original=original):
                submits.append(offset)
                return _original(f, offset, buf, future)

            monkeypatch.setattr(io.engine, name, spy)
        io.read_ranges(path, views)
        assert len(views) > 10 and len(submits) <= -(-data.size // (4 * MIB)) + 1
        assert len(io.pool._free) == io.pool._created  # every staging block back
    for offset, view in views:
        assert bytes(view) == data[offset : offset + view.nbytes].tobytes(), f"range at {offset}"


def test_a_vectored_read_past_the_end_names_the_file(disk_dir: Path, engine: str, make_data) -> None:
    data = make_data(3 * MIB, seed=2)
    path = disk_dir / "short.bin"
    path.write_bytes(data.tobytes())
    memory = AlignedBuffer(8 * MIB)
    with AioHandle(AioConfig(engine=engine, block_size=4 * MIB)) as io:
        ok = [(64, memory.view(MIB, 64)), (MIB + 64, memory.view(MIB, 2 * MIB + 64))]
        with pytest.raises(AioError, match="short.bin"):
            io.read_ranges(path, ok + [(2 * MIB + 64, memory.view(MIB + 1, 4 * MIB + 64))])  # one byte too far
        io.read_ranges(path, ok)
        assert len(io.pool._free) == io.pool._created
    assert bytes(memory.view(MIB, 64)) == data[64 : MIB + 64].tobytes()
    assert bytes(memory.view(MIB, 2 * MIB + 64)) == data[MIB + 64 : 2 * MIB + 64].tobytes()
