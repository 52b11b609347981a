"""The KV cache: in memory, or on disk when it exceeds its own budget.

Both layouts are token-major, ``[capacity, batch, kv_heads, head_dim]`` per layer for K and for V, so
a step's new tokens are one contiguous range and the two kinds of cache run the same attention code
on the same strides (identical logits). :class:`MemoryKV` holds every layer. :class:`DiskKV` keeps
each layer's K/V block in one file and only ``slots`` layer blocks in memory: a reader thread fills
them, in layer order, with the tokens cached so far (O_DIRECT through :mod:`aio`, into page-aligned
reused buffers) while earlier layers compute, alongside the executor's weight reads; after a layer
attends, the pages its new tokens touched are written back asynchronously, and a buffer is refilled
only once its writes are done.

The executor does not see the difference: a model's attention asks :meth:`KVCache.layer` for layer
``i``'s K and V within a ``with`` block, writes its new tokens, attends, and the block's end hands the
layer back (written back to disk for :class:`DiskKV`).
"""

from __future__ import annotations

import abc
import os
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from aio import AioConfig, AioHandle, AlignedBuffer
from aio.engines import create_engine
from aio.files import open_file, preallocate
from aio.sizes import format_size
from training.inference.errors import BudgetError, InferenceError

ALIGN = 4096
KV_IO = AioConfig(block_size=4 << 20, queue_depth=16)


def _round_up(n: int, m: int = ALIGN) -> int:
    return (n + m - 1) // m * m


def _round_down(n: int, m: int = ALIGN) -> int:
    return n // m * m


def _row_bytes(batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token slot of one layer's K (or V): a cache's row, and make_cache's sizing unit."""
    return batch * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class KVStats:
    """What a cache moved: bytes to and from disk, time in reads, compute's wait for them, resident bytes."""

    offloaded: bool = False
    resident_bytes: int = 0  # memory holding K/V (all of it in memory; the layer buffers on disk)
    total_bytes: int = 0  # the whole cache's size
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    slots: int = 0  # layer blocks in memory (DiskKV)


class KVCache(abc.ABC):
    """K and V of every layer for ``capacity`` token slots of ``batch`` rows."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype):
        self.n_layers, self.batch, self.kv_heads, self.head_dim = n_layers, batch, kv_heads, head_dim
        self.capacity, self.dtype = capacity, dtype
        self.row = _row_bytes(batch, kv_heads, head_dim, dtype)  # bytes per token
        self.stats = KVStats(total_bytes=2 * n_layers * capacity * self.row)

    @abc.abstractmethod
    def layer(self, i: int, start: int, end: int) -> AbstractContextManager[tuple[torch.Tensor, torch.Tensor]]:
        """A context giving layer ``i``'s K, V ``[capacity, B, kv, hd]`` (slots ``[0, start)`` filled); the
        caller writes slots ``[start, end)`` inside it."""

    def close(self) -> None:  # noqa: B027 - nothing to release in memory
        """Release buffers, threads and files."""

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryKV(KVCache):
    """Every layer's K/V in memory on ``device`` (zeros at first)."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ):
        super().__init__(n_layers, batch, kv_heads, head_dim, capacity, dtype)
        shape = (capacity, batch, kv_heads, head_dim)
        self._kv = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(n_layers)
        ]
        self.stats.resident_bytes = self.stats.total_bytes

    @contextmanager
    def layer(self, i: int, start: int, end: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield self._kv[i]


class DiskKV(KVCache):
    """Every layer's K/V block in a file under ``directory`` (a fresh temporary directory in it, removed
    on close); ``budget`` bytes of memory hold up to ``n_layers`` layer blocks, read ahead in layer order.

    BudgetError when ``budget`` cannot hold one layer's block, naming the size needed.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        budget: int,
        *,
        directory: str | os.PathLike[str] | None = None,
        aio_config: AioConfig | None = None,
    ) -> None:
        super().__init__(n_layers, batch, kv_heads, head_dim, capacity, dtype)
        self.region = _round_up(capacity * self.row)  # K (then V) of one layer, page-rounded
        self.block = 2 * self.region
        if budget < self.block:
            raise BudgetError(
                f"KV cache budget {format_size(budget)} is too small: one layer's K/V block (batch {batch} x "
                f"{capacity} tokens x {kv_heads} kv heads x {head_dim}) needs {format_size(self.block)}; a KV budget "
                f"of at least {format_size(self.block)} ({self.block} bytes) is needed to offload it to disk "
                f"(the whole cache in memory: {format_size(self.stats.total_bytes)})"
            )
        self.slots = min(n_layers, budget // self.block)  # at most one pass ahead: a layer is read after its write
        cfg = aio_config or KV_IO
        self._dir = tempfile.mkdtemp(prefix="ucp-kv-", dir=None if directory is None else os.fspath(directory))
        self.path = os.path.join(self._dir, "kv.bin")
        self._wfile = None
        self._engine = None
        self._handle: AioHandle | None = None
        self._thread: threading.Thread | None = None
        try:
            self._wfile = open_file(self.path, "w", direct=cfg.use_direct)
            preallocate(self._wfile, n_layers * self.block)
            os.ftruncate(self._wfile.fd, n_layers * self.block)
            self._engine = create_engine(cfg)  # the compute thread's writes
            self._handle = AioHandle(cfg)  # the reader thread's reads
            self._saved = [0] * n_layers  # tokens on disk per layer
            self._pending: list[list[Future]] = [[] for _ in range(n_layers)]  # a layer's writes in flight
            # a buffer comes back with the writes still reading from it: refilled once they are done
            self._free: queue.Queue[tuple[AlignedBuffer, list[Future]] | None] = queue.Queue()
            self._ready: queue.Queue[tuple[int, AlignedBuffer, BaseException | None]] = queue.Queue()
            self.buffers = [AlignedBuffer(self.block, pin=None) for _ in range(self.slots)]
            for b in self.buffers:
                self._free.put((b, []))
            self._next = 0  # the layer compute takes next
            self._failed: BaseException | None = None
            self.stats.offloaded, self.stats.slots = True, self.slots
            self.stats.resident_bytes = self.slots * self.block
            self._thread = threading.Thread(target=self._read_loop, name="ucp-kv-reader", daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise

    def _views(self, buf: AlignedBuffer) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.capacity, self.batch, self.kv_heads, self.head_dim)
        n = self.capacity * self.row
        k = torch.frombuffer(buf.view(n, 0), dtype=self.dtype).view(shape)
        v = torch.frombuffer(buf.view(n, self.region), dtype=self.dtype).view(shape)
        return k, v

    def _read_loop(self) -> None:
        assert self._handle is not None
        i = 0
        while True:
            item = self._free.get()
            if item is None:
                return
            buf, writes = item
            t0 = time.perf_counter()
            try:
                # the buffer's last writes are done before it is refilled, and this layer's last
                # write-back is on disk before it is read
                for fut in (*writes, *self._pending[i]):
                    fut.result()
                n = _round_up(self._saved[i] * self.row)
                if n:
                    at = i * self.block
                    self._handle.read_ranges(
                        self.path, [(at, buf.view(n, 0)), (at + self.region, buf.view(n, self.region))]
                    )
            except BaseException as exc:  # noqa: BLE001 - handed to the compute thread
                self._ready.put((i, buf, exc))
                return
            self.stats.read_seconds += time.perf_counter() - t0
            self.stats.bytes_read += 2 * n
            self._ready.put((i, buf, None))
            i = (i + 1) % self.n_layers

    @contextmanager
    def layer(self, i: int, start: int, end: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._failed is not None:
            raise InferenceError(f"the KV cache on disk ({self.path}) stopped after an earlier error: {self._failed}")
        if end > self.capacity:
            raise InferenceError(f"KV cache holds {self.capacity} tokens, step writes up to {end}")
        t0 = time.perf_counter()
        got, buf, exc = self._ready.get()
        self.stats.wait_seconds += time.perf_counter() - t0
        if exc is not None:
            self._failed = exc
            raise InferenceError(f"reading the KV cache of layer {got} from {self.path} failed: {exc}") from exc
        if got != i or i != self._next or self._saved[i] != start:
            self._failed = InferenceError(f"out of order: layer {i} from slot {start}")
            raise InferenceError(
                f"KV cache used out of order: layer {i} from slot {start} asked for, layer {got} "
                f"holding {self._saved[got]} tokens is next"
            )
        try:
            yield self._views(buf)
        except BaseException as exc:
            self._failed = exc
            self._free.put((buf, []))  # nothing written: the reader may move on
            raise
        writes = self._write_back(i, buf, start, end)
        self._next = (i + 1) % self.n_layers
        self._free.put((buf, writes))

    def _write_back(self, i: int, buf: AlignedBuffer, start: int, end: int) -> list[Future]:
        """Submit writes of the pages holding slots ``[start, end)`` of K and of V (the earlier bytes of
        the first page were read in; the tail past ``end`` is never attended)."""
        assert self._engine is not None and self._wfile is not None
        lo, hi = _round_down(start * self.row), _round_up(end * self.row)
        futs: list[Future] = []
        if hi > lo:
            for base in (0, self.region):
                view = buf.view(hi - lo, base + lo)
                futs.append(self._engine.submit_write(self._wfile, i * self.block + base + lo, view))
            self.stats.bytes_written += 2 * (hi - lo)
        self._pending[i] = futs
        self._saved[i] = end
        return futs

    def close(self) -> None:
        """Stop the reader, wait for writes in flight, free the buffers, remove the file."""
        if self._thread is not None:
            self._free.put(None)
            self._thread.join()
            self._thread = None
        for futs in getattr(self, "_pending", []):
            for fut in futs:
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001, S110 - the cache is being discarded
                    pass
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._wfile is not None:
            self._wfile.close()
            self._wfile = None
        shutil.rmtree(self._dir, ignore_errors=True)


class DeviceKV(KVCache):
    """A :class:`DiskKV` whose layers attend on ``device``: the layer block read from disk into (pinned)
    host memory is copied to one device K/V pair, the step's new tokens are copied back into the host
    block, and the block's write-back goes on as in :class:`DiskKV`. On a CPU device the copies are
    plain copies: the staged path's test in CI. The copies are not overlapped with compute (the disk
    reads are, in DiskKV's reader thread)."""

    def __init__(self, inner: DiskKV, device: torch.device) -> None:
        super().__init__(inner.n_layers, inner.batch, inner.kv_heads, inner.head_dim, inner.capacity, inner.dtype)
        self.inner, self.device = inner, device
        shape = (inner.capacity, inner.batch, inner.kv_heads, inner.head_dim)
        self._k = torch.empty(shape, dtype=inner.dtype, device=device)
        self._v = torch.empty(shape, dtype=inner.dtype, device=device)
        self.stats = inner.stats
        self.stats.resident_bytes += 2 * inner.capacity * inner.row  # the device pair

    @contextmanager
    def layer(self, i: int, start: int, end: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with self.inner.layer(i, start, end) as (kh, vh):
            self._k[:start].copy_(kh[:start], non_blocking=True)  # ordered before attention on the same stream
            self._v[:start].copy_(vh[:start], non_blocking=True)
            yield self._k, self._v
            kh[start:end].copy_(self._k[start:end])  # synchronous: the write-back reads the host block next
            vh[start:end].copy_(self._v[start:end])

    def close(self) -> None:
        self.inner.close()


def make_cache(
    n_layers: int,
    batch: int,
    kv_heads: int,
    head_dim: int,
    capacity: int,
    dtype: torch.dtype,
    *,
    budget: int | None = None,
    directory: str | os.PathLike[str] | None = None,
    device: torch.device | None = None,
) -> KVCache:
    """In memory when ``budget`` is None or holds the whole cache, else on disk within ``budget``.
    ``device`` (the staged and gds paths): the in-memory cache lives there, and an offloaded one
    attends there through :class:`DeviceKV`; None: the CPU path's plain caches."""
    total = 2 * n_layers * capacity * _row_bytes(batch, kv_heads, head_dim, dtype)  # the cache's stats.total_bytes
    if budget is None or total <= budget:
        return MemoryKV(n_layers, batch, kv_heads, head_dim, capacity, dtype, device)
    disk = DiskKV(n_layers, batch, kv_heads, head_dim, capacity, dtype, budget, directory=directory)
    return disk if device is None else DeviceKV(disk, device)
