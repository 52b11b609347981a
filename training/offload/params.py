"""Parameters on NVMe (ZeRO-Infinity's ``offload_param``, ZeRO-3): each rank's compute-dtype partitions in swap files.

At ZeRO-3 a rank holds, per parameter, a flat *partition* of ``1/D`` of it in the compute dtype, all-gathered
only while a module runs (:mod:`training.zero.stage3`). With ``offload_param.device: nvme`` those partitions
live in swap files in the run's own swap directory (:class:`~training.offload.swapdir.SwapDir`), one file per
partition, and move through ``aio`` (O_DIRECT, requests of at most ``aio.block_size``) in *chunks* of at most
one buffer each:

* **Buffers.** A chunk is at most ``buffer_size`` elements (rounded down to the device's I/O alignment, at
  least one block). Chunks move through page-aligned, pre-faulted buffers lent by a :class:`BytePool` whose
  size is a byte budget: ``buffer_count`` × ``buffer_size`` elements, DeepSpeed's pool; but a buffer is the
  size of its chunk, so a small partition takes only its own bytes of the budget, not a whole buffer, and
  buffers are kept for reuse by size. A partition larger than one buffer is cut into chunks, read and
  written one after the other through the pool (DeepSpeed refuses such a parameter: it must fit one buffer).
* **Reads** run on one I/O thread. :meth:`ParamOffload.load` returns the partition as a tensor of its own
  (the buffers go back to the pool at once, so a buffer is never held across a collective); chunks read
  ahead by :meth:`ParamOffload.read_ahead` are taken as they are, the rest are read then (a read ahead that
  holds the buffer a needed read waits for is dropped, the farthest first, so the pool cannot deadlock).
  The gatherer reads ahead in the module order recorded on the first step (:class:`OffloadedPartitions`).
* **Writes** (the optimizer's new weights, a load) run on one I/O thread; :meth:`ParamOffload.flush` waits
  for them. Every read of a partition first drops a read ahead of it and the writes are flushed before the
  next forward, so no read ever sees an old record.
* **Integrity.** Every chunk's CRC-32C is noted when written and checked when read, and a read that comes
  back short (the file was truncated) fails: :class:`OffloadError` naming the file, the parameter and the
  partition, never silent garbage. Files are preallocated, so a device too small fails at start-up.
* **max_in_cpu** keeps DeepSpeed's meaning: that many elements of the partitions (the first, in parameter
  order) stay in host memory and are never swapped; so do partitions smaller than one I/O block
  (DeepSpeed keeps those under 1 MiB).

:class:`ParamTier` is what :class:`training.zero.ZeroOptimizer` calls: whole ZeRO-group partitions in and out
of the per-parameter files, and the partitions staged for a checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import crc32c
import torch
from torch import nn

from aio.buffers import AlignedBuffer, round_down, round_up
from aio.engines import Engine, create_engine
from aio.errors import AioError, is_no_space
from aio.files import open_file, preallocate
from aio.transfer import transfer
from ucp.store.file_ranges import FileRange

from .config import OffloadConfig
from .errors import OffloadError, os_reason
from .swapdir import SwapDir

if TYPE_CHECKING:
    from training.zero.groups import GroupPlan


class BytePool:
    """Aligned, pre-faulted buffers lent against a byte budget: a buffer is the size asked for, kept when given
    back for the next request of that size; buffers kept of other sizes are let go when a new one would break
    the budget. ``acquire`` waits (or, not ``block``, returns None) while the bytes lent leave no room."""

    def __init__(self, budget: int, *, pin: bool = False) -> None:
        self.budget, self._pin = budget, pin
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._free_bytes = self._lent = 0
        self.peak = 0  # the most bytes held at once (lent and kept)
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, block: bool = True) -> AlignedBuffer | None:
        if nbytes > self.budget:
            raise ValueError(f"a buffer of {nbytes} bytes is larger than the pool's budget of {self.budget}")
        with self._cond:
            while True:
                same = self._free.get(nbytes)
                if same:
                    self._free_bytes -= nbytes
                    self._lent += nbytes
                    return same.pop()
                if self._lent + nbytes <= self.budget:
                    while self._lent + self._free_bytes + nbytes > self.budget:  # let kept buffers of other sizes go
                        size = next(n for n, kept in self._free.items() if kept)
                        self._free[size].pop()
                        self._free_bytes -= size
                    self._lent += nbytes
                    self.peak = max(self.peak, self._lent + self._free_bytes)
                    break
                if not block:
                    return None
                self._cond.wait()
        try:
            return AlignedBuffer(nbytes, pin=self._pin)
        except BaseException:
            with self._cond:
                self._lent -= nbytes
                self._cond.notify_all()
            raise

    def release(self, buf: AlignedBuffer) -> None:
        with self._cond:
            self._lent -= buf.nbytes
            self._free.setdefault(buf.nbytes, []).append(buf)
            self._free_bytes += buf.nbytes
            self._cond.notify_all()

    @property
    def lent(self) -> int:
        """Bytes lent out now (0 when every buffer is back)."""
        return self._lent

    @property
    def held(self) -> int:
        """Bytes held now (lent and kept for reuse)."""
        return self._lent + self._free_bytes


@dataclass(frozen=True)
class Partition:
    """This rank's partition of parameter ``name``: ``numel`` elements of its flat (padded) tensor from ``lo``."""

    index: int
    name: str
    numel: int
    lo: int
    rank: int
    parts: int

    def describe(self) -> str:
        return (
            f"parameter {self.name!r} (partition {self.rank} of {self.parts}: "
            f"elements [{self.lo}, {self.lo + self.numel}) of its flat tensor)"
        )


class ParamOffload:
    """The NVMe tier of this rank's parameter partitions (``config.offload_param``; see the module doc).

    ``dtype``: the compute dtype the partitions are kept in; ``device``: where :meth:`load` puts them.
    """

    def __init__(
        self,
        config: OffloadConfig,
        partitions: Sequence[Partition],
        dtype: torch.dtype,
        *,
        rank: int,
        device: torch.device | str = "cpu",
    ) -> None:
        pc = config.offload_param
        if pc.device != "nvme" or pc.nvme_path is None:
            raise ValueError("ParamOffload needs offload_param.device nvme and its nvme_path")
        self.partitions = list(partitions)
        self.dtype, self.device = dtype, torch.device(device)
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.dir = SwapDir(pc.nvme_path, rank=rank, what="param", key="offload_param.nvme_path")
        self.alignment = self.dir.alignment
        self.chunk_bytes = max(self.alignment, round_down(pc.buffer_size * self.itemsize, self.alignment))
        self.buffer_count = max(1, pc.buffer_count)
        pin = pc.pin_memory and torch.cuda.is_available()
        self.pool = BytePool(self.buffer_count * self.chunk_bytes, pin=bool(pin))
        self.aio = config.aio.model_copy(update={"alignment": self.alignment})
        self.block = max(self.alignment, self.aio.block_size // self.alignment * self.alignment)
        # max_in_cpu (DeepSpeed's meaning): the first partitions, up to that many elements, stay in host memory;
        # so does any partition smaller than one I/O block (a whole request for a few bytes).
        self._resident: dict[int, torch.Tensor] = {}
        kept, full = 0, False
        for part in self.partitions:
            small = part.numel * self.itemsize < self.alignment
            if not small and not full and kept + part.numel > pc.max_in_cpu:
                full = True  # a prefix, as DeepSpeed's flat host buffer is: every later partition goes to the device
            if small or not full:
                kept += 0 if small else part.numel
                self._resident[part.index] = torch.zeros(part.numel, dtype=dtype, device=self.device)
        self._paths = {
            p.index: self.dir.file(f"param-{p.index:05d}.swp") for p in self.partitions if p.index not in self._resident
        }
        self._crc: dict[int, list[int | None]] = {k: [None] * self.chunks(k) for k in self._paths}
        self._engine = create_engine(self.aio)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ucp-param-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ucp-param-write")
        self._ahead: dict[int, list[Future[AlignedBuffer]]] = {}  # partition -> its chunks read ahead, in order
        self._writes: list[Future[None]] = []
        self._count = threading.Lock()
        self.bytes_read = self.bytes_written = 0
        self.read_seconds = self.write_seconds = 0.0  # I/O threads busy
        self.read_wait = 0.0  # seconds load() waited for reads
        self.loads = self.hits = 0  # partitions loaded from the device; of those, read ahead in full
        try:
            for k, path in self._paths.items():
                part = self.partitions[k]
                with open_file(path, "w", direct=self.aio.use_direct) as f:
                    preallocate(f, self.file_bytes(k))
        except AioError as exc:
            self.close()
            raise self._io_error("reserving space for", part, exc) from exc
        except BaseException:
            self.close()
            raise

    # -- layout ------------------------------------------------------------------------------------
    def file_bytes(self, k: int) -> int:
        return round_up(self.partitions[k].numel * self.itemsize, self.alignment)

    def chunks(self, k: int) -> int:
        return -(-self.file_bytes(k) // self.chunk_bytes)

    def _chunk(self, k: int, c: int) -> tuple[int, int, int]:
        """Chunk ``c`` of partition ``k``: (byte offset, bytes moved (aligned), bytes of data)."""
        off = c * self.chunk_bytes
        length = min(self.chunk_bytes, self.file_bytes(k) - off)
        data = min(length, self.partitions[k].numel * self.itemsize - off)
        return off, length, data

    def swapped(self, k: int) -> bool:
        return k in self._paths

    def path(self, k: int) -> Path:
        return self._paths[k]

    @property
    def resident_bytes(self) -> int:
        return sum(t.numel() for t in self._resident.values()) * self.itemsize

    # -- writing -----------------------------------------------------------------------------------
    @torch.no_grad()
    def write(self, k: int, src: torch.Tensor) -> None:
        """Partition ``k`` becomes ``src`` (1-d, its ``numel`` elements, any dtype: cast to the compute dtype on
        the way). Returns once ``src`` is copied out; :meth:`flush` waits for the device."""
        part = self.partitions[k]
        if src.numel() != part.numel:
            raise ValueError(f"{part.describe()}: {src.numel()} elements given, the partition has {part.numel}")
        if k in self._resident:
            self._resident[k].copy_(src)
            return
        self._drop(k)  # what was read ahead of it is old now
        flat = src.detach().reshape(-1)
        for c in range(self.chunks(k)):
            off, length, data = self._chunk(k, c)
            buf = self.pool.acquire(length)
            assert buf is not None  # a blocking acquire always lends one
            try:
                raw = buf.tensor(length)
                e0, e1 = off // self.itemsize, (off + data) // self.itemsize
                raw[:data].view(self.dtype).copy_(flat[e0:e1])
                raw[data:].zero_()
            except BaseException:
                self.pool.release(buf)
                raise
            self._writes.append(self._writer.submit(self._write_chunk, k, c, buf))

    @torch.no_grad()
    def write_parts(self, k: int, parts: Iterable[torch.Tensor]) -> None:
        """Partition ``k`` becomes the concatenation of ``parts`` (1-d tensors of any dtype, its ``numel`` elements
        in all), cast into one pool buffer at a time and written chunk by chunk as each fills: never the whole
        partition in memory (a load streaming the masters in, training.offload.checkpoint). :meth:`flush` waits."""
        part = self.partitions[k]
        if k in self._resident:
            at = 0
            for t in parts:
                self._resident[k][at : at + t.numel()].copy_(t)
                at += t.numel()
            if at != part.numel:
                raise ValueError(f"{part.describe()}: {at} elements given, the partition has {part.numel}")
            return
        self._drop(k)
        c, filled, at = 0, 0, 0
        buf: AlignedBuffer | None = None
        dst = torch.empty(0, dtype=self.dtype)
        try:
            for t in parts:
                pos, n = 0, t.numel()
                while pos < n:
                    if buf is None:
                        if c >= self.chunks(k):
                            raise ValueError(f"{part.describe()}: more than its {part.numel} elements given")
                        _, length, data = self._chunk(k, c)
                        buf = self.pool.acquire(length)
                        assert buf is not None  # a blocking acquire always lends one
                        raw = buf.tensor(length)
                        raw[data:].zero_()
                        dst, filled = raw[:data].view(self.dtype), 0
                    m = min(n - pos, dst.numel() - filled)
                    dst[filled : filled + m].copy_(t[pos : pos + m])
                    filled, pos, at = filled + m, pos + m, at + m
                    if filled == dst.numel():
                        self._writes.append(self._writer.submit(self._write_chunk, k, c, buf))
                        buf, c = None, c + 1
            if buf is not None or at != part.numel:
                raise ValueError(f"{part.describe()}: {at} elements given, the partition has {part.numel}")
        except BaseException:
            if buf is not None:
                self.pool.release(buf)
            raise

    def stream(self, k: int, lo: int, hi: int) -> Iterator[memoryview]:
        """The bytes of elements ``[lo, hi)`` of partition ``k``, read chunk by chunk through the pool and checked
        (a save streaming them, training.offload.checkpoint): consecutive views, each valid until the next is
        asked for. No write may be in flight (:meth:`flush`) nor a read ahead held (:meth:`drop_ahead`)."""
        if k in self._resident:
            flat = self._resident[k][lo:hi]
            yield flat.view(torch.uint8).numpy().data
            return
        a, b = lo * self.itemsize, hi * self.itemsize
        for c in range(self.chunks(k)):
            off, length, data = self._chunk(k, c)
            x, y = max(a, off), min(b, off + data)
            if x >= y:
                continue
            buf = self.pool.acquire(length)
            assert buf is not None
            self._read_chunk(k, c, buf)  # gives the buffer back itself if it fails
            try:
                yield buf.view(length)[x - off : y - off]
            finally:
                self.pool.release(buf)

    def _write_chunk(self, k: int, c: int, buf: AlignedBuffer) -> None:
        t0 = time.perf_counter()
        try:
            off, length, _ = self._chunk(k, c)
            view = buf.view(length)
            crc = self._crc[k]
            crc[c] = crc32c.crc32c(view)
            try:
                error = transfer(self._engine, self._paths[k], view, write=True, block=self.block, direct=self.aio.use_direct, offset=off)[0]  # fmt: skip
            except AioError as exc:
                error = exc
            if error is not None:
                crc[c] = None
                raise self._io_error("writing", self.partitions[k], error, self._paths[k]) from error
            with self._count:
                self.bytes_written += length
                self.write_seconds += time.perf_counter() - t0
        finally:
            self.pool.release(buf)

    def flush(self) -> None:
        """Wait for every write issued; raise the first one's error."""
        writes, self._writes = self._writes, []
        error: BaseException | None = None
        for fut in writes:
            exc = fut.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error

    # -- reading -----------------------------------------------------------------------------------
    def _read_chunk(self, k: int, c: int, buf: AlignedBuffer) -> AlignedBuffer:
        """Read chunk ``c`` of partition ``k`` into ``buf`` and check it (the read thread's job); the buffer goes
        back to the pool if it fails."""
        t0 = time.perf_counter()
        length = self._chunk(k, c)[1]
        try:
            self.fetch_chunk(k, c, buf.view(length))
        except BaseException:
            self.pool.release(buf)
            raise
        with self._count:
            self.bytes_read += length
            self.read_seconds += time.perf_counter() - t0
        return buf

    def fetch_chunk(
        self, k: int, c: int, view: memoryview, *, copy: tuple[Path, Engine, list[int | None]] | None = None
    ) -> None:
        """Fill ``view`` (aligned, the chunk's bytes) with chunk ``c`` of partition ``k`` and check it came back whole
        and unchanged; ``copy``: from a copy of its swap file ``(path, the engine to read it with, its chunks'
        CRC-32Cs as copied)`` (:class:`ParamCopy`)."""
        part = self.partitions[k]
        path, engine, expected = (
            (self._paths[k], self._engine, self._crc[k][c]) if copy is None else (copy[0], copy[1], copy[2][c])
        )
        what = "swap file" if copy is None else "copy of the swap file"
        off, length, _ = self._chunk(k, c)
        if expected is None:
            raise OffloadError(f"{what} {path} of {part.describe()} has no record: it was never written whole")
        try:
            error, whole, size = transfer(engine, path, view, write=False, block=self.block, direct=self.aio.use_direct, offset=off)  # fmt: skip
        except AioError as exc:  # opening it (the file was removed under the run)
            raise self._io_error("reading", part, exc, path) from exc
        if error is not None:
            raise self._io_error("reading", part, error, path) from error
        if not whole:
            raise OffloadError(
                f"{what} {path} of {part.describe()} is truncated: {size} bytes, the partition needs "
                f"{self.file_bytes(k)} (changed under the run; the parameter is lost)"
            )
        got = crc32c.crc32c(view)
        if got != expected:
            raise OffloadError(
                f"{what} {path} of {part.describe()} is corrupt: bytes [{off}, {off + length}) have CRC-32C "
                f"{got:#010x}, written as {expected:#010x} (changed under the run; the parameter is lost)"
            )

    def _issue(self, k: int, futures: list[Future[AlignedBuffer]], block: bool) -> bool:
        """Issue the read of partition ``k``'s next chunk not yet in ``futures`` (its reads in flight, appended
        to); False if no buffer was free."""
        buf = self.pool.acquire(self._chunk(k, len(futures))[1], block=block)
        if buf is None:
            return False
        futures.append(self._reader.submit(self._read_chunk, k, len(futures), buf))
        return True

    def read_ahead(self, order: Iterable[int]) -> None:
        """Start reading the partitions of ``order`` (the next needed first) into free buffers, as far as the
        pool's free buffers go; never waits."""
        for k in order:
            if k not in self._paths:
                continue
            futures = self._ahead.get(k, [])
            while len(futures) < self.chunks(k):
                if not self._issue(k, futures, block=False):
                    break
            if futures:
                self._ahead[k] = futures
            if len(futures) < self.chunks(k):
                return

    @torch.no_grad()
    def load(self, k: int) -> torch.Tensor:
        """Partition ``k`` as a tensor (compute dtype, on the tier's device): the resident one, or a new one read
        from its swap file (chunks read ahead are taken, the rest read now; each buffer goes back at once)."""
        if k in self._resident:
            return self._resident[k]
        t0 = time.perf_counter()
        n = self.chunks(k)
        futures = self._ahead.pop(k, [])
        self.loads += 1
        self.hits += int(len(futures) == n)
        self._ahead = {k: futures, **self._ahead}  # this one first: it is never the one dropped for room
        out = torch.empty(self.partitions[k].numel, dtype=self.dtype, device=self.device)
        raw = out.view(torch.uint8)
        c = 0
        try:
            for c in range(n):
                if len(futures) <= c:
                    self._room_for(k, futures)
                while len(futures) < n and self._issue(k, futures, block=False):  # the rest of it behind this chunk
                    pass
                buf = futures[c].result()
                off, _, data = self._chunk(k, c)
                raw[off : off + data].copy_(buf.tensor(data))
                self.pool.release(buf)
        except BaseException:
            self._ahead.pop(k, None)
            _release(self.pool, futures[c:])  # the chunks not consumed (those before went back already)
            raise
        self._ahead.pop(k, None)
        self.read_wait += time.perf_counter() - t0
        return out

    def _room_for(self, k: int, futures: list[Future[AlignedBuffer]]) -> None:
        """Issue partition ``k``'s next chunk, dropping reads ahead of other partitions (the farthest first)
        while no buffer is free, so a needed read never waits on a buffer a read ahead holds."""
        while not self._issue(k, futures, block=False):
            others = [j for j in self._ahead if j != k]
            if not others:
                self._issue(
                    k, futures, block=True
                )  # only writes and this partition's reads hold buffers: they come back
                return
            self._drop(others[-1])

    def _drop(self, k: int) -> None:
        """Forget what was read ahead of partition ``k`` (waiting for its reads, its buffers back to the pool)."""
        _release(self.pool, self._ahead.pop(k, []))

    def drop_ahead(self) -> None:
        """Forget every read ahead (an aborted pass, a checkpoint, close)."""
        for k in list(self._ahead):
            self._drop(k)

    # -- the rest ----------------------------------------------------------------------------------
    def _io_error(self, doing: str, part: Partition, exc: BaseException, path: Path | None = None) -> OffloadError:
        where = getattr(exc, "filename", None) or path or self._paths.get(part.index)
        if is_no_space(exc):
            why = "the device is full"
        else:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return OffloadError(f"{doing} swap file {where} of {part.describe()} failed: {why}")

    def stats(self) -> dict[str, float]:
        return {
            "bytes_read": float(self.bytes_read),
            "bytes_written": float(self.bytes_written),
            "io_read": self.read_seconds,
            "io_write": self.write_seconds,
            "read_wait": self.read_wait,
            "loads": float(self.loads),
            "hits": float(self.hits),
        }

    def describe(self) -> dict[str, Any]:
        """The tier's shape, for logs and reports."""
        return {
            "device": "nvme",
            "dir": str(self.dir.path),
            "alignment": self.alignment,
            "partitions": len(self.partitions),
            "swapped": len(self._paths),
            "resident_bytes": self.resident_bytes,
            "buffer_bytes": self.chunk_bytes,
            "buffers": self.buffer_count,
            "budget": self.pool.budget,
            "pool_bytes": self.pool.held,
            "pool_peak": self.pool.peak,
            "file_bytes": sum(self.file_bytes(k) for k in self._paths),
            "read_ahead": len(self._ahead),
        }

    def close(self) -> None:
        """Finish the I/O, stop its threads, remove the swap directory (idempotent)."""
        if getattr(self, "_reader", None) is not None:
            self.drop_ahead()
            try:
                self.flush()
            except BaseException:  # noqa: BLE001 - closing: the state goes with the directory
                pass
            self._reader.shutdown(wait=True)
            self._writer.shutdown(wait=True)
            self._engine.close()
        self.dir.remove()


def _release(pool: BytePool, reads: Sequence[Future[AlignedBuffer]]) -> None:
    """Wait for ``reads`` and give their buffers back (a read that failed gave its own back)."""
    for fut in reads:
        try:
            exc = fut.exception()
        except BaseException:  # noqa: BLE001 - cancelled
            continue
        if exc is None:
            pool.release(fut.result())


class ParamCopy:
    """The parameter tier's swap files as a save found them, copied on disk, for an asynchronous save that streams
    them on its writer thread while training goes on (as :class:`training.offload.checkpoint.TierCopy` does for
    the optimizer's): made once the tier is quiet, with each chunk's CRC-32C as written; the copy runs on a thread
    of its own and the tier must not be written before :meth:`wait`. Partitions kept in host memory
    (``max_in_cpu``, those under one block) are cloned. Reads go through an aio engine and one chunk buffer of
    its own. ``files`` (a writer process reads the copy, :meth:`ranges`): the cloned partitions are written to
    files of the copy too, chunk by chunk, each chunk's CRC-32C noted."""

    def __init__(self, tier: ParamTier, *, files: bool = False) -> None:
        from .checkpoint import copy_file

        tier.quiesce()
        off = self.offload = tier.offload
        self._crcs = {k: list(v) for k, v in off._crc.items()}
        self._resident = {k: t.clone() for k, t in off._resident.items()}
        self._files = files
        self._resident_crcs: dict[int, list[int]] = {}  # with ``files``: each chunk's CRC-32C, once written
        self.dir = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=off.dir.path))
        self._paths = {k: self.dir / path.name for k, path in off._paths.items()}
        self._engine: Engine | None = create_engine(off.aio)
        self._buf: AlignedBuffer | None = None
        self._copy_file = copy_file
        pool = ThreadPoolExecutor(1, thread_name_prefix="ucp-param-copy")
        self.copied: Future[None] = pool.submit(self._copy)
        pool.shutdown(wait=False)

    def _copy(self) -> None:
        off = self.offload
        for k, dst in self._paths.items():
            src = off.path(k)
            try:
                self._copy_file(src, dst)
            except OSError as exc:
                why = os_reason(exc)
                part = off.partitions[k].describe()
                raise OffloadError(
                    f"copying swap file {src} of {part} to {dst} for a checkpoint failed: {why}"
                ) from exc
        if self._files:
            for k in self._resident:
                self._write_resident(k)

    def _resident_path(self, k: int) -> Path:
        return self.dir / f"resident-{k:05d}.bin"

    def _write_resident(self, k: int) -> None:
        """Write cloned partition ``k`` to its file of the copy, noting each chunk's CRC-32C."""
        data = self._resident[k].detach().cpu().contiguous().view(torch.uint8).numpy().data
        step, path = self.offload.chunk_bytes, self._resident_path(k)
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as exc:
            why = os_reason(exc)
            part = self.offload.partitions[k].describe()
            raise OffloadError(f"writing {part} (kept in memory) to {path} for a checkpoint failed: {why}") from exc
        self._resident_crcs[k] = [crc32c.crc32c(data[a : a + step]) for a in range(0, data.nbytes, step)]

    def ranges(self, k: int, lo: int, hi: int) -> list[FileRange]:
        """Where elements ``[lo, hi)`` of partition ``k`` lie in the copy, chunk by chunk, each chunk a block with
        its CRC-32C as copied: what a writer process reads (:class:`ucp.store.file_ranges.RangeReader`; the copy
        was made with ``files``). Waits for the copy, raises its error."""
        self.copied.result()
        off = self.offload
        a, b = lo * off.itemsize, hi * off.itemsize
        what = f"copy of the swap file of {off.partitions[k].describe()} for a checkpoint"
        if k in self._resident:
            if not self._files:
                raise RuntimeError("ParamCopy.ranges: the copy was made without files=True")
            crcs, step, total = self._resident_crcs[k], off.chunk_bytes, off.partitions[k].numel * off.itemsize
            chunks: list[tuple[int, int, int, int | None]] = [(c * step, min(step, total - c * step), min(step, total - c * step), crc) for c, crc in enumerate(crcs)]  # fmt: skip
            path, alignment, what = self._resident_path(k), 0, what.replace("swap file", "memory")
        else:
            chunks = []
            for c in range(off.chunks(k)):
                start, length, data = off._chunk(k, c)
                chunks.append((start, length, data, self._crcs[k][c]))
            path, alignment = self._paths[k], off.alignment
        out = []
        for c, (start, length, data, crc) in enumerate(chunks):
            x, y = max(a, start), min(b, start + data)
            if x < y:
                assert crc is not None  # a swap file's chunks were all written (the copy checked the tier)
                out.append(FileRange(path=str(path), offset=start, length=length, crc32c=crc, start=x - start, stop=y - start, what=f"{what}: chunk {c}", alignment=alignment))  # fmt: skip
        return out

    def wait(self) -> None:
        """Wait until the copy is made (or failed: the save reports it); the tier may change from then on."""
        _ = self.copied.exception()

    def stream(self, k: int, lo: int, hi: int) -> Iterator[memoryview]:
        """:meth:`ParamOffload.stream` from the copy: each view valid until the next is asked for."""
        self.copied.result()
        off = self.offload
        if k in self._resident:
            yield self._resident[k][lo:hi].view(torch.uint8).numpy().data
            return
        assert self._engine is not None, "the copy was closed"
        if self._buf is None:
            self._buf = AlignedBuffer(off.chunk_bytes)
        a, b = lo * off.itemsize, hi * off.itemsize
        for c in range(off.chunks(k)):
            start, length, data = off._chunk(k, c)
            x, y = max(a, start), min(b, start + data)
            if x < y:
                view = self._buf.view(length)
                off.fetch_chunk(k, c, view, copy=(self._paths[k], self._engine, self._crcs[k]))
                yield view[x - start : y - start]

    def close(self) -> None:
        """Remove the copy and free what reads it (after the save that reads it is done); idempotent."""
        self.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        engine, self._engine, self._buf = self._engine, None, None
        if engine is not None:
            engine.close()


class OffloadedPartitions:
    """A :class:`training.zero.stage3.ParamGatherer`'s source of partitions: each parameter's from the tier."""

    def __init__(self, offload: ParamOffload, index: dict[nn.Parameter, int]) -> None:
        self.offload, self.index = offload, index

    def partition(self, p: nn.Parameter) -> torch.Tensor:
        return self.offload.load(self.index[p])

    def read_ahead(self, params: Iterable[nn.Parameter]) -> None:
        self.offload.read_ahead(self.index[p] for p in params if p in self.index)

    def drop(self) -> None:
        self.offload.drop_ahead()


class ParamTier:
    """ZeRO-3's compute-dtype partitions on NVMe, as :class:`training.zero.ZeroOptimizer` uses them: whole group
    partitions (``plans[g].size`` elements, each parameter's at ``plans[g].offsets[i]``) written to and staged
    from the per-parameter files of a :class:`ParamOffload`."""

    def __init__(
        self,
        config: OffloadConfig,
        plans: Sequence[GroupPlan],
        params: dict[str, nn.Parameter],
        dtype: torch.dtype,
        *,
        rank: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.plans = list(plans)
        self.dtype, self.device = dtype, torch.device(device)
        self._where: list[tuple[int, int, int, int]] = []  # partition -> (group, offset in the group, numel, param i)
        parts: list[Partition] = []
        index: dict[nn.Parameter, int] = {}
        for g, plan in enumerate(self.plans):
            for i, name in enumerate(plan.names):
                size = plan.param_part_size(i)
                parts.append(Partition(len(parts), name, size, plan.rank * size, plan.rank, plan.parts))
                index[params[name]] = len(self._where)
                self._where.append((g, plan.offsets[i], size, i))
        self.offload = ParamOffload(config, parts, dtype, rank=rank, device=device)
        self.source = OffloadedPartitions(self.offload, index)
        self._staged: list[torch.Tensor] | None = None

    def write_group(self, g: int, src: torch.Tensor) -> None:
        """Group ``g``'s partition becomes ``src`` (``plans[g].size`` elements, any dtype); :meth:`flush` waits."""
        for k, (group, off, size, _) in enumerate(self._where):
            if group == g and size:
                self.offload.write(k, src[off : off + size])

    def flush(self) -> None:
        self.offload.flush()

    def quiesce(self) -> None:
        """Before a checkpoint reads the swap files: no write in flight, no read ahead holding a buffer."""
        self.offload.drop_ahead()
        self.flush()

    def locate(self, g: int, at: int) -> tuple[int, int, int]:
        """The partition holding element ``at`` of group ``g``'s partition: ``(its index, its offset in the group's
        partition, its numel)``; ValueError if none does."""
        for k, (group, off, size, _) in enumerate(self._where):
            if group == g and off <= at < off + size:
                return k, off, size
        raise ValueError(f"group {g}: element {at} of its partition lies in no parameter's partition")

    @torch.no_grad()
    def write_from(self, masters: Callable[[int, int, int], Iterable[memoryview]]) -> None:
        """Every partition from fp32 masters, streamed: ``masters(g, lo, hi)`` yields the bytes of elements
        ``[lo, hi)`` of group ``g``'s fp32 partition part by part (each valid until the next is asked for), cast
        into the pool's buffers on the way (:meth:`ParamOffload.write_parts`); waits for the writes."""
        for k, (g, off, size, _) in enumerate(self._where):
            if size:
                views = masters(g, off, off + size)
                self.offload.write_parts(k, (torch.frombuffer(v, dtype=torch.float32) for v in views))
        self.flush()

    def stage(self) -> list[torch.Tensor]:
        """Every group's partition as a whole tensor read from the tier (kept until dropped or pushed): what a
        checkpoint saves, or fills on a load."""
        if self._staged is None:
            self.offload.drop_ahead()
            staged = [torch.zeros(plan.size, dtype=self.dtype, device=self.device) for plan in self.plans]
            for k, (g, off, size, _) in enumerate(self._where):
                if size:
                    staged[g][off : off + size].copy_(self.offload.load(k))
            self._staged = staged
        return self._staged

    def push_staged(self) -> None:
        """Write the staged partitions (as a load filled them) back to the tier."""
        staged = self.stage()
        for g, t in enumerate(staged):
            self.write_group(g, t)
        self.flush()
        self._staged = None

    def drop_staged(self) -> None:
        self._staged = None

    def close(self) -> None:
        self._staged = None
        self.offload.close()


__all__ = ["BytePool", "OffloadedPartitions", "ParamCopy", "ParamOffload", "ParamTier", "Partition"]
