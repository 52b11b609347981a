"""Find the fastest ``AioConfig`` for one directory, by measuring it.

The best block size, queue depth and thread count depend on the device, the
file system and the CPU, so they are searched rather than guessed (the idea of
DeepSpeed's ``ds_nvme_tune``): every candidate writes a file of ``size`` bytes
(fsync included) and reads it back cold into a reused buffer, and the candidate
with the least total time wins. Every byte read back is compared with what was
written (after the clock stops), so a fast but wrong read is never ranked. The
result is printed in both config formats, UCP's ``AioConfig`` and DeepSpeed's
``aio`` section.

This module also holds the small measuring helpers the benchmarks share
(dropping the page cache, filling a buffer with incompressible bytes, comparing
what was read with what was written), because it is the lowest layer that needs them.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from pydantic import BaseModel, Field

from .buffers import AlignedBuffer
from .config import GIB, MIB, AioConfig, EngineName
from .engines import libaio_status
from .handle import AioHandle
from .sizes import format_size
from .workdir import WorkDir

# -- shared measuring helpers -----------------------------------------------------------

DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache() -> tuple[bool, str]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` so the next read comes from the device.

    Returns whether it worked and, when not, why (it needs root, and a container
    may mount /proc/sys read-only).
    """
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError as exc:
        return False, f"cannot write {DROP_CACHES}: {exc.strerror or exc}"
    return True, "page cache dropped before every read"


def evict_file(path: str | os.PathLike[str]) -> bool:
    """Evict one file's clean pages (``posix_fadvise(DONTNEED)``; needs no root): its next read goes to
    the device. Dirty pages stay, so sync first. False when the file system or OS does not allow it."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def fill_random(dest: np.ndarray, seed: int = 0) -> None:
    """Fill a uint8 array with incompressible, non-repeating bytes, fast.

    One random 8 MiB block is generated; every 8 MiB chunk of ``dest`` is that block
    XOR a constant derived from the chunk index, so no two chunks are equal (nothing
    for a deduplicating or compressing device to exploit) at memory speed.
    """
    if dest.dtype != np.uint8 or dest.ndim != 1:
        raise ValueError("fill_random needs a flat uint8 array")
    chunk = 8 * MIB
    rng = np.random.default_rng(seed)
    base = np.frombuffer(rng.bytes(chunk), dtype=np.uint64)
    for i, start in enumerate(range(0, dest.nbytes, chunk)):
        n = min(chunk, dest.nbytes - start)
        key = np.uint64((0x9E3779B97F4A7C15 * (i + 1)) & 0xFFFFFFFFFFFFFFFF)
        mixed = np.bitwise_xor(base, key)
        dest[start : start + n] = mixed.view(np.uint8)[:n]


def poison(dest: np.ndarray, ranges: Iterable[tuple[int, int]] | None = None) -> None:
    """Invert the bytes about to be checked (all of them by default), so that stale data from an
    earlier read cannot pass: a byte the next read leaves alone no longer matches."""
    if ranges is None:
        ranges = [(0, dest.nbytes)]
    for off, n in ranges:
        np.bitwise_not(dest[off : off + n], out=dest[off : off + n])


COMPARE_CHUNK = 16 * MIB  # bytes compared at a time: bounds the temporary array numpy makes


def first_mismatch(
    expected: np.ndarray, got: np.ndarray, ranges: Iterable[tuple[int, int]] | None = None
) -> int | None:
    """The offset of the first byte that differs (or of a size mismatch), else ``None``.

    Every byte is compared, a chunk at a time, unless ``ranges`` names the ``(offset, length)``
    ranges to compare. Both arrays are flat uint8.
    """
    if got.nbytes != expected.nbytes:
        return min(got.nbytes, expected.nbytes)
    if ranges is None:
        ranges = [(off, min(COMPARE_CHUNK, expected.nbytes - off)) for off in range(0, expected.nbytes, COMPARE_CHUNK)]
    for off, n in ranges:
        a, b = expected[off : off + n], got[off : off + n]
        if not np.array_equal(a, b):
            return off + int(np.flatnonzero(a != b)[0])
    return None


# AioConfig fields DeepSpeed has no key for: a flat object naming one is UCP's own config.
UCP_ONLY_KEYS = frozenset({"engine", "use_direct", "alignment", "fsync"})

_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def config_from_json(data: Any) -> AioConfig:
    """An ``AioConfig`` from any of the shapes configs come in: ``ucp tune`` output
    (``{"ucp": {"aio": ...}}``), a DeepSpeed config or its ``aio`` section, or a flat AioConfig.

    A DeepSpeed config or section means what it means to DeepSpeed (its defaults fill the keys it
    leaves out); a flat object naming a UCP-only field (``engine``, ``use_direct``, ...) is read as
    UCP's own AioConfig, with UCP's defaults. ValueError when ``data`` is not a JSON object.
    """
    if not isinstance(data, dict):
        raise ValueError(f"an aio config must be a JSON object, got {_JSON_TYPES.get(type(data), type(data).__name__)}")
    ucp = data.get("ucp")
    if isinstance(ucp, dict) and isinstance(ucp.get("aio"), dict):
        return AioConfig.model_validate(ucp["aio"])
    if "aio" not in data and UCP_ONLY_KEYS & data.keys():
        return AioConfig.model_validate(data)
    return AioConfig.from_deepspeed(data)


# -- the search -----------------------------------------------------------------------------


_DEFAULT_ENGINES: list[EngineName] = ["libaio", "threads"]


class TuneGrid(BaseModel):
    """The candidate values; every combination that makes sense is measured."""

    engines: list[EngineName] = Field(default_factory=lambda: _DEFAULT_ENGINES.copy())
    block_sizes: list[int] = Field(default_factory=lambda: [1 * MIB, 4 * MIB, 8 * MIB, 16 * MIB])
    queue_depths: list[int] = Field(default_factory=lambda: [8, 32])
    thread_counts: list[int] = Field(default_factory=lambda: [4, 8])

    @classmethod
    def quick(cls) -> "TuneGrid":
        return cls(block_sizes=[1 * MIB, 8 * MIB], queue_depths=[8, 32], thread_counts=[4])

    def candidates(self, base: AioConfig | None = None, size: int | None = None) -> Iterator[AioConfig]:
        """Configs to try. ``thread_count`` only matters to the threads engine, and a thread
        count above the queue depth would leave threads idle, so those are skipped. Given the
        test file's ``size``, block sizes above it are measured once (see :meth:`block_sizes_for`)."""
        base = base or AioConfig()
        block_sizes = self.block_sizes if size is None else self.block_sizes_for(size, base.alignment)
        for engine in self.engines:
            for bs in block_sizes:
                for qd in self.queue_depths:
                    threads = self.thread_counts if engine == "threads" else [base.thread_count]
                    for tc in threads:
                        if engine == "threads" and tc > qd:
                            continue
                        fields = {"engine": engine, "block_size": bs, "queue_depth": qd, "thread_count": tc}
                        yield AioConfig.model_validate({**base.model_dump(), **fields})  # validates bs, qd

    def oversized(self, size: int) -> list[int]:
        """The block sizes larger than a ``size``-byte test file."""
        return [bs for bs in self.block_sizes if bs > size]

    def block_sizes_for(self, size: int, alignment: int = 4096) -> list[int]:
        """The block sizes worth measuring on a ``size``-byte file. A request never moves more than
        the file holds, so all block sizes above ``size`` are one and the same experiment: they are
        measured once, as the largest block that fits (``size`` rounded down to the alignment)."""
        unit = max(4096, alignment)  # a block is a multiple of both
        fits = size // unit * unit
        if fits == 0:
            raise ValueError(f"tune size {size} is smaller than one aligned block ({unit} bytes)")
        return list(dict.fromkeys(min(bs, fits) for bs in self.block_sizes))

    def plan(self, size: int, base: AioConfig | None = None) -> list[AioConfig]:
        """The configs a run on a ``size``-byte file measures; ValueError naming the grid if there are none."""
        found = list(self.candidates(base, size))
        if not found:
            raise ValueError(
                f"the tune grid has no candidate (engines={self.engines}, "
                f"block_sizes={[format_size(b) for b in self.block_sizes]}, queue_depths={self.queue_depths}, "
                f"thread_counts={self.thread_counts}): every list needs a value, and the threads engine "
                "a thread count no larger than some queue depth"
            )
        return found


class Trial(BaseModel):
    """One candidate's measurements (medians over the repeats)."""

    config: AioConfig
    write_gbps: float = Field(description="10^9 bytes/s, fsync included")
    read_gbps: float = Field(description="10^9 bytes/s, cold")
    seconds: float = Field(description="median write + read time; the ranking key")


class TuneResult(BaseModel):
    """What ``ucp tune`` found."""

    directory: str
    size_bytes: int
    repeats: int
    direct_io: bool = Field(description="whether the file system accepted O_DIRECT")
    cold_reads: bool
    cold_note: str
    skipped_engines: dict[str, str] = Field(default_factory=dict, description="engine -> why it was not measured")
    collapsed_block_sizes: list[int] = Field(
        default_factory=list,
        description="grid block sizes larger than the file: one experiment, measured once as the largest block that fits",
    )
    trials: list[Trial]
    best: AioConfig = Field(description="least write + read time")
    best_write: AioConfig
    best_read: AioConfig

    def config_sections(self) -> dict[str, Any]:
        """The winner in both formats: UCP's ``aio`` config and DeepSpeed's ``aio`` section."""
        return {"ucp": {"aio": self.best.model_dump(mode="json")}, "deepspeed": {"aio": self.best.to_deepspeed()}}


ProgressFn = Callable[[str], None]


def run_tune(
    directory: str | os.PathLike[str] | None = None,
    *,
    size: int = 1 * GIB,
    grid: TuneGrid | None = None,
    repeats: int = 1,
    base: AioConfig | None = None,
    progress: ProgressFn | None = None,
) -> TuneResult:
    """Measure every candidate of ``grid`` on ``directory`` and return the ranking.

    ``directory`` defaults to the current working directory (so the disk under test
    is the one the user is on, not /dev/shm). The test file lives in a fresh directory
    made inside it, removed at the end with any directory made on the way (see
    :class:`~aio.workdir.WorkDir`), so no file of the user's is touched. Needs about
    ``size`` bytes free there, and twice ``size`` of memory.
    """
    if size < 4096:
        raise ValueError(f"tune size must be at least 4096 bytes, got {size}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    base = base or AioConfig()
    grid = grid or TuneGrid()
    engines, skipped = _usable_engines(grid.engines)
    if grid.engines and not engines:
        raise RuntimeError(f"no usable aio engine among {grid.engines}: {skipped}")
    candidates = grid.model_copy(update={"engines": engines}).plan(size, base)  # before any work

    work = WorkDir(Path(directory) if directory is not None else None, ".ucp-tune-")
    times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(candidates))}
    cold, cold_note, direct = True, "", True
    try:
        _check_free_space(work, size)
        path = work.path / "ucp-tune.bin"
        source = AlignedBuffer(size, pin=False)
        fill_random(source.numpy())
        out = AlignedBuffer(size, pin=False)
        # Repeats are interleaved (every candidate once, then again) so slow drifts of the
        # device (a flush in the background, thermal limits) spread over all candidates.
        for rep in range(repeats):
            for i, cfg in enumerate(candidates):
                if progress:
                    progress(f"[{rep + 1}/{repeats}] {describe(cfg)}")
                w, r, d, (dropped, why) = _measure(cfg, path, source, out)
                if cold:  # once a drop failed, keep the first reason
                    cold, cold_note = dropped, why
                direct = direct and d
                times[i].append((w, r))
    finally:
        work.remove()

    trials = []
    for i, cfg in enumerate(candidates):
        w = statistics.median(t[0] for t in times[i])
        r = statistics.median(t[1] for t in times[i])
        trials.append(Trial(config=cfg, write_gbps=size / w / 1e9, read_gbps=size / r / 1e9, seconds=w + r))
    trials.sort(key=lambda t: t.seconds)
    return TuneResult(
        directory=str(work.shown),
        size_bytes=size,
        repeats=repeats,
        direct_io=direct,
        cold_reads=cold,
        cold_note=cold_note,
        skipped_engines=skipped,
        collapsed_block_sizes=grid.oversized(size),
        trials=trials,
        best=trials[0].config,
        best_write=max(trials, key=lambda t: t.write_gbps).config,
        best_read=max(trials, key=lambda t: t.read_gbps).config,
    )


def _check_free_space(work: WorkDir, size: int) -> None:
    """RuntimeError, before anything is written, if the disk cannot hold the test file."""
    free = shutil.disk_usage(work.path).free
    need = size + size // 16 + 64 * MIB  # the file, plus room for the file system's own blocks
    if free < need:
        raise RuntimeError(f"{work.shown} has {free / GIB:.2f} GiB free; tune needs about {need / GIB:.2f} GiB")


def describe(cfg: AioConfig) -> str:
    """A one-line label of the tuned fields, e.g. ``libaio bs=8M qd=32``."""
    label = f"{cfg.engine} bs={format_size(cfg.block_size)} qd={cfg.queue_depth}"
    return label + (f" threads={cfg.thread_count}" if cfg.engine == "threads" else "")


def _usable_engines(wanted: list[EngineName]) -> tuple[list[EngineName], dict[str, str]]:
    usable: list[EngineName] = []
    skipped: dict[str, str] = {}
    for engine in dict.fromkeys(wanted):
        if engine == "libaio":
            ok, why = libaio_status()
            if not ok:
                skipped[engine] = why
                continue
        usable.append(engine)
    return usable, skipped


def _measure(
    cfg: AioConfig, path: Path, source: AlignedBuffer, out: AlignedBuffer
) -> tuple[float, float, bool, tuple[bool, str]]:
    """Write then cold-read ``path`` once with ``cfg``; returns (write s, read s, direct, cold).

    Every byte read is compared with ``source`` once the clock has stopped.
    """
    with AioHandle(cfg) as io:
        t0 = time.perf_counter()
        with io.writer(path, size_hint=source.nbytes, fsync=True) as w:
            direct = w.direct
            w.write(source.view())
        write_s = time.perf_counter() - t0
        cold = drop_page_cache()
        poison(out.numpy())  # the last candidate's bytes, still in ``out``, must not pass for this read's
        t0 = time.perf_counter()
        io.read_file(path, out=out)
        read_s = time.perf_counter() - t0
    bad = first_mismatch(source.numpy(), out.numpy())
    path.unlink()
    if bad is not None:
        raise RuntimeError(f"tune read back wrong data from {path} at offset {bad} with {describe(cfg)}")
    return write_s, read_s, direct, cold
