"""Many files and many requests in flight at once, from several Python threads sharing one handle."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from aio import AioConfig, AioHandle, AlignedBuffer

KIB, MIB = 1 << 10, 1 << 20
N_FILES, N_THREADS = 16, 4


def _write_one(io: AioHandle, path: Path, data: np.ndarray, i: int) -> None:
    if i % 2 == 0:
        io.write_file(path, data)
        return
    step = 1000 + 997 * i  # uneven pieces, different for each file
    with io.writer(path, size_hint=data.nbytes if i % 4 == 1 else None) as w:
        for start in range(0, data.nbytes, step):
            w.write(data[start : start + step])


def _read_one(io: AioHandle, path: Path, data: np.ndarray, i: int) -> None:
    n = data.nbytes
    if i % 3 == 0:
        got = io.read_file(path).numpy()
        assert np.array_equal(got, data), path
    elif i % 3 == 1:
        dest = np.zeros(n + 1, dtype=np.uint8)[1:]
        io.read_into(path, 0, dest)
        assert np.array_equal(dest, data), path
    else:
        cuts = sorted({0, n, *np.random.default_rng(i).integers(0, n + 1, 20).tolist()})
        ranges = [(a, np.zeros(b - a, dtype=np.uint8)) for a, b in zip(cuts, cuts[1:])]
        io.read_ranges(path, ranges)
        assert np.array_equal(np.concatenate([d for _, d in ranges]), data), path


@pytest.mark.timeout(180)  # a starved buffer pool would hang rather than fail
@pytest.mark.parametrize(
    "queue_depth,block_size",
    [(2, 4 * KIB), (64, 4 * KIB), (2, 1 * MIB), (64, 256 * KIB), (2, 8 * MIB), (64, 8 * MIB)],
    ids=lambda v: str(v),
)
def test_sixteen_files_from_threads_sharing_one_handle(engine, disk_dir, make_data, queue_depth, block_size):
    # sizes from empty to a few MiB, mostly unaligned
    sizes = [0, 1, 4096, 4097] + [int(s) for s in np.random.default_rng(0).integers(5 * KIB, 3 * MIB, N_FILES - 4)]
    datas = [make_data(n, seed=i) for i, n in enumerate(sizes)]
    paths = [disk_dir / f"f{i:02d}.bin" for i in range(N_FILES)]
    cfg = AioConfig(engine=engine, queue_depth=queue_depth, block_size=block_size, fsync=False)
    with AioHandle(cfg) as io, ThreadPoolExecutor(N_THREADS) as pool:
        for fut in [pool.submit(_write_one, io, p, d, i) for i, (p, d) in enumerate(zip(paths, datas))]:
            fut.result()
        for p, d in zip(paths, datas):
            assert p.read_bytes() == d.tobytes(), p
        for fut in [pool.submit(_read_one, io, p, d, i) for i, (p, d) in enumerate(zip(paths, datas))]:
            fut.result()


def test_more_open_writers_in_one_thread_than_pool_buffers(engine, disk_dir, make_data):
    """Interleaved writers hold a partly filled block each; the pool must not starve them (no hang)."""
    cfg = AioConfig(engine=engine, queue_depth=2, block_size=64 * KIB, fsync=False)
    n_files = 3 * (cfg.queue_depth + 2)
    datas = [make_data(500_000 + i, seed=i) for i in range(n_files)]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with AioHandle(cfg) as io, ExitStack() as stack:
                writers = [stack.enter_context(io.writer(disk_dir / f"m{i}.bin")) for i in range(n_files)]
                for start in range(0, 500_000 + n_files, 30_001):
                    for w, d in zip(writers, datas):
                        w.write(d[start : start + 30_001])
        except BaseException as exc:  # reported below, from the test's thread
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "writers deadlocked waiting for staging buffers"
    assert not errors, errors
    for i, d in enumerate(datas):
        assert (disk_dir / f"m{i}.bin").read_bytes() == d.tobytes()


def test_concurrent_reads_of_one_file_into_one_buffer(engine, disk_dir, make_data):
    """Threads filling disjoint slices of one destination, as a loader filling one tensor would."""
    data = make_data(6 * MIB + 5, seed=3)
    path = disk_dir / "one.bin"
    out = AlignedBuffer(data.nbytes, pin=False)
    dest = out.numpy()
    with AioHandle(AioConfig(engine=engine, block_size=512 * KIB, queue_depth=8)) as io:
        io.write_file(path, data)
        cuts = [0, 1, 4096, 1 * MIB + 7, 2 * MIB, 3 * MIB + 4095, 5 * MIB, data.nbytes]
        with ThreadPoolExecutor(N_THREADS) as pool:
            futs = [pool.submit(io.read_into, path, a, dest[a:b]) for a, b in zip(cuts, cuts[1:])]
            assert [f.result() for f in futs] == [b - a for a, b in zip(cuts, cuts[1:])]
    assert np.array_equal(dest, data)
