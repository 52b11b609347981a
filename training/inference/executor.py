"""The layer-streaming executor: weights stay on disk and pass through a ring of reused aligned buffers.

A forward pass visits the model's groups in order: ``pre`` (embedding), every layer, ``post`` (final
norm and head). Groups kept *resident* are read once; the others are *streamed*: a reader thread
fills the ring's free buffers with the next groups, in the cyclic order the passes consume them (the
last layer of one pass is followed by the first of the next), so while layer ``i`` computes, layers
``i+1 .. i+k`` are being read, ``k`` = ring buffers - 1, chosen from the budget. Reads are O_DIRECT
through :mod:`aio` (libaio where present) into page-aligned, pre-faulted buffers that are never
freed or re-faulted, so weights do not pass through the page cache and the process's resident memory
stays at ring + resident tensors.

The budget covers weight memory: the ring and the resident tensors (held in the compute dtype). With
``pin_layers`` (the default), what the budget holds beyond the edge groups and a two-buffer ring (or
``prefetch + 1`` buffers) keeps whole layers resident too, spread evenly over the depth: a layer read
once instead of once per pass is the largest saving a batch-1 decode, bound by the disk, can get.

That is the ``cpu`` read path. On a device (``staged``, ``gds``: :mod:`training.inference.device`)
the ring and the resident tensors live in device memory, which the budget then counts.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Generator, Sequence

import torch

from aio import AioConfig, AlignedBuffer
from aio.sizes import format_size
from training.inference.device import (
    DeviceRing,
    KvikioReader,
    Lane,
    ReadPath,
    choose_read_path,
    placed_views,
    probe_kvikio_read,
    resolve_device,
)
from training.inference.errors import BudgetError, InferenceError
from training.inference.files import RangeReader
from training.inference.layout import FileSizes, GroupLayout, Placed, layout_group
from training.inference.model import Step, StreamModel
from training.inference.sources import TensorSource, WeightSource
from ucp.format.dtypes import itemsize, torch_dtype

READ_CONFIG = AioConfig(block_size=4 << 20, queue_depth=32)  # few staging blocks: aligned spans read direct
LOCAL_READERS = 2  # reader threads of the host ring on local files: the next group's reads overlap the last's tail


@dataclass
class Plan:
    """How the budget is spent: what stays resident, the ring's buffers and prefetch depth."""

    budget: int
    resident: list[str]  # group labels kept in memory
    resident_bytes: int
    slot_bytes: int
    slots: int
    streamed: list[GroupLayout] = field(repr=False)
    pinned: list[int] = field(default_factory=list)  # layers kept resident

    @property
    def prefetch(self) -> int:
        return self.slots - 1

    @property
    def ring_bytes(self) -> int:
        return self.slots * self.slot_bytes if self.streamed else 0

    @property
    def streamed_bytes_per_pass(self) -> int:
        return sum(g.read_bytes for g in self.streamed)


def plan_budget(
    pre: GroupLayout,
    layers: list[GroupLayout],
    post: GroupLayout,
    budget: int,
    *,
    resident_bytes: int,
    prefetch: int | None = None,
    layer_resident_bytes: list[int] | None = None,
) -> Plan:
    """Keep pre/post resident when the rest still leaves two layer buffers; else stream them too. With
    ``layer_resident_bytes`` (each layer's size held resident), pin whole layers in what the budget
    holds beyond the resident edges and a ring of ``prefetch + 1`` (default 2) buffers.

    BudgetError when the budget cannot hold the largest streamed group, naming it, its largest tensor
    and the budget needed.
    """
    layer_slot = max((g.nbytes for g in layers), default=0)
    if budget >= resident_bytes + 2 * layer_slot or (budget >= resident_bytes + layer_slot and prefetch == 0):
        streamed, resident, resident_names, slot = layers, resident_bytes, [pre.label, post.label], layer_slot
    else:
        streamed, resident, resident_names = [pre, *layers, post], 0, []
        slot = max(g.nbytes for g in streamed)
    if budget < resident + slot:
        worst = max(streamed, key=lambda g: g.nbytes)
        big = worst.largest
        raise BudgetError(
            f"memory budget {format_size(budget)} is too small: {worst.label} needs a buffer of {format_size(worst.nbytes)} "
            f"(largest tensor {big.name!r}, {format_size(big.nbytes)}); a budget of at least "
            f"{format_size(resident + slot)} ({resident + slot} bytes) is needed to stream it"
        )
    pinned: list[int] = []
    if layer_resident_bytes is not None and resident_names:
        pinned = _pick_pinned(layer_resident_bytes, budget - resident, slot, 2 if prefetch is None else prefetch + 1)
        resident += sum(layer_resident_bytes[i] for i in pinned)
        resident_names += [layers[i].label for i in pinned]
        streamed = [g for i, g in enumerate(layers) if i not in set(pinned)]
    slots = (budget - resident) // slot
    slots = min(slots, len(streamed) + 1)
    if prefetch is not None:
        slots = min(slots, prefetch + 1)
    return Plan(budget, resident_names, resident, slot, max(1, slots), streamed, pinned)


def _pick_pinned(sizes: list[int], room: int, slot: int, ring: int) -> list[int]:
    """Layers to keep resident in ``room`` bytes: all when they fit, else as many as leave ``ring``
    buffers of ``slot`` bytes, spread evenly over the depth."""
    n = len(sizes)
    if sum(sizes) <= room:
        return list(range(n))
    room -= ring * slot
    if room <= 0 or not sizes:
        return []
    for k in range(min(n - 1, room // min(sizes)), 0, -1):
        chosen = sorted({min(n - 1, int((j + 0.5) * n / k)) for j in range(k)})
        if sum(sizes[i] for i in chosen) <= room:
            return chosen
    return []


@dataclass
class ReadStats:
    """What the reader did and how long compute waited for it."""

    bytes_read: int = 0
    read_seconds: float = 0.0  # the reader thread's time inside reads
    wait_seconds: float = 0.0  # the compute thread's time waiting for a group to arrive
    groups_read: int = 0

    @property
    def hidden_fraction(self) -> float:
        """Share of read time overlapped with compute (1: reads never held compute up)."""
        if self.read_seconds <= 0:
            return 1.0
        return max(0.0, min(1.0, 1.0 - self.wait_seconds / self.read_seconds))


def tensor_views(buf: AlignedBuffer, placed: list[Placed], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buf`` (no copy when already in ``dtype`` and element-aligned)."""
    return placed_views(placed, dtype, lambda p: torch.frombuffer(buf.view(p.nbytes, p.at), dtype=torch.uint8))


class _Ring:
    """Buffers cycling between reader threads (fill) and the compute thread (uses, then releases).

    ``readers`` threads each take a free buffer and the next group in order, so while compute waits
    for group ``i`` the read of ``i + 1`` is already in flight in the buffer compute just released: the
    disk's queue stays full across group boundaries instead of draining at the end of every group (one
    reader waits for a group's last request before it submits the next group's first). Groups are
    handed to compute in order whichever read finishes first."""

    def __init__(
        self, groups: list[GroupLayout], slots: int, slot_bytes: int, handle: RangeReader, readers: int = 2
    ) -> None:
        self.groups, self.handle, self.stats = groups, handle, ReadStats()
        self._free: queue.Queue[AlignedBuffer | None] = queue.Queue()
        self._done: dict[int, tuple[AlignedBuffer, BaseException | None]] = {}
        self._cond = threading.Condition()
        self.buffers = [AlignedBuffer(slot_bytes, pin=None) for _ in range(slots)]
        self._stop = False
        self._next = 0  # the next group (counted over passes) a reader takes
        self._taken = 0  # the next group compute takes
        self._active, self._busy_since = 0, 0.0  # readers inside a read; when the first began
        for b in self.buffers:
            self._free.put(b)
        self._threads = [
            threading.Thread(target=self._run, name=f"ucp-infer-reader-{n}", daemon=True)
            for n in range(max(1, min(readers, slots)))
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            buf = self._free.get()
            with self._cond:
                if buf is None or self._stop:
                    return
                i, self._next = self._next, self._next + 1
                if self._active == 0:
                    self._busy_since = time.perf_counter()
                self._active += 1
            g = self.groups[i % len(self.groups)]
            error: BaseException | None = None
            try:
                load_group(self.handle, g, buf)
            except BaseException as exc:  # noqa: BLE001 - handed to the compute thread
                error = exc
            with self._cond:
                self._active -= 1
                if self._active == 0:  # read time is wall time with a read in flight, not the sum of reads
                    self.stats.read_seconds += time.perf_counter() - self._busy_since
                if error is None:
                    self.stats.bytes_read += g.read_bytes
                    self.stats.groups_read += 1
                self._done[i] = (buf, error)
                self._cond.notify_all()
            if error is not None:
                return

    def take(self, index: int) -> AlignedBuffer:
        t0 = time.perf_counter()
        with self._cond:
            while self._taken not in self._done:
                self._cond.wait()
            buf, exc = self._done.pop(self._taken)
            got = self._taken % len(self.groups)
            self._taken += 1
            if self._active:  # reads overlapping without a pause: count the busy time so far
                now = time.perf_counter()
                self.stats.read_seconds += now - self._busy_since
                self._busy_since = now
        self.stats.wait_seconds += time.perf_counter() - t0
        if exc is not None:
            raise exc
        assert got == index, f"ring out of order: got group {got}, wanted {index}"
        return buf

    def views(self, buf: AlignedBuffer, g: GroupLayout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return tensor_views(buf, g.tensors, dtype)

    def release(self, buf: AlignedBuffer) -> None:
        self._free.put(buf)

    def close(self) -> None:
        with self._cond:
            self._stop = True
        for _ in self._threads:
            self._free.put(None)
        for t in self._threads:
            t.join()


def held_bytes(tensors: Sequence[Placed | TensorSource], dtype: torch.dtype, as_read: int | None = None) -> int:
    """Memory ``tensors`` take resident in compute ``dtype``: floating tensors converted to it. When
    none needs converting and ``as_read`` is given, the buffer they were read into (its views keep it)."""
    size = torch.empty((), dtype=dtype).element_size()
    floats = [torch_dtype(t.dtype).is_floating_point for t in tensors]
    if as_read is not None and all(torch_dtype(t.dtype) == dtype for t, f in zip(tensors, floats) if f):
        return as_read
    return sum((t.nbytes // itemsize(t.dtype)) * (size if f else itemsize(t.dtype)) for t, f in zip(tensors, floats))


def load_group(handle: RangeReader, g: GroupLayout, buf: AlignedBuffer) -> None:
    """Read every range of ``g`` into ``buf`` (all ranges of a file in flight together): through ``aio``
    for local files, ranged GETs for an object store's (:mod:`training.inference.files`)."""
    for file, reads in g.reads.items():
        handle.read_ranges(file, [(off, buf.view(n, at)) for off, at, n in reads])


class Executor:
    """Runs forward passes of ``model`` with weights streamed from ``source`` within ``budget`` bytes."""

    def __init__(
        self,
        model: StreamModel,
        source: WeightSource,
        budget: int,
        *,
        prefetch: int | None = None,
        dtype: torch.dtype = torch.float32,
        aio_config: AioConfig | None = None,
        pin_layers: bool = True,
        device: str | torch.device = "cpu",
        read_path: str | None = None,
        kvikio: object | None = None,
    ) -> None:
        """``device``: where compute runs (the budget then counts device memory). ``read_path``: how
        streamed weights reach it (:mod:`training.inference.device`): None picks ``cpu`` on the CPU,
        ``gds`` on a GPU where KvikIO imports, else ``staged``. ``kvikio``: a stand-in for the kvikio
        module (tests)."""
        import gds

        self.device = resolve_device(device)
        self.read_path: ReadPath = choose_read_path(self.device, read_path, gds.capabilities())
        self.read_path_reason = "asked for" if read_path not in (None, "auto") else f"auto on {self.device}"
        model.check_weights(source)
        if self.read_path == "gds" and source.files.remote:
            if read_path not in (None, "auto"):
                raise InferenceError(
                    f"{source.root}: read path 'gds' reads local files (KvikIO); weights on an object store "
                    "take 'staged' or 'cpu'"
                )
            self.read_path, self.read_path_reason = (
                "staged",
                "auto: weights on an object store (KvikIO reads local files)",
            )
        if self.read_path == "gds" and read_path in (None, "auto"):
            first = next(r.file for t in source.tensors.values() for r in t.runs)
            why = probe_kvikio_read(first, self.device, kvikio)
            if why is not None:
                self.read_path, self.read_path_reason = "staged", f"auto: KvikIO could not read {first} ({why})"
        self.model, self.source, self.dtype = model, source, dtype
        sizes = FileSizes(source.files.size)
        pre = layout_group("embedding", model.pre_names(), source, sizes)
        layers = [layout_group(f"layer {i}", model.layer_names(i), source, sizes) for i in range(model.n_layers)]
        post = layout_group("final norm and head", model.post_names(), source, sizes)
        unique = {t.name: t for t in (*pre.tensors, *post.tensors)}
        resident_bytes = held_bytes(list(unique.values()), dtype)
        self.plan = plan_budget(
            pre,
            layers,
            post,
            budget,
            resident_bytes=resident_bytes,
            prefetch=prefetch,
            layer_resident_bytes=[held_bytes(g.tensors, dtype, g.nbytes) for g in layers] if pin_layers else None,
        )
        self.handle = source.files.reader(aio_config or READ_CONFIG)
        self.resident: dict[str, torch.Tensor] = {}
        self.resident_stats = ReadStats()
        if self.plan.resident:
            t0 = time.perf_counter()
            rest = [n for n in model.post_names() if n not in model.pre_names()]  # a tied head is the embedding
            for g in (pre, layout_group(post.label, rest, source, sizes), *(layers[i] for i in self.plan.pinned)):
                buf = AlignedBuffer(g.nbytes)
                load_group(self.handle, g, buf)
                self.resident_stats.bytes_read += g.read_bytes
                # views keep ``buf`` alive where no conversion copied them; converted ones let it go
                views = tensor_views(buf, g.tensors, dtype)
                self.resident.update({n: t.to(self.device) for n, t in views.items()})
                del buf, views
            self.resident_stats.read_seconds = time.perf_counter() - t0
        self._streams_pre = not self.plan.resident
        self._pinned = set(self.plan.pinned)
        self.lane = Lane(self.device)
        self._ring: _Ring | DeviceRing | None = None
        if self.plan.streamed and self.read_path == "cpu":
            readers = 1 if source.files.remote else LOCAL_READERS  # an object store's client: one thread
            self._ring = _Ring(self.plan.streamed, self.plan.slots, self.plan.slot_bytes, self.handle, readers)
        elif self.plan.streamed:
            reader = KvikioReader(kvikio) if self.read_path == "gds" else None
            self._ring = DeviceRing(
                self.plan.streamed,
                self.plan.slots,
                self.plan.slot_bytes,
                self.lane,
                handle=None if reader is not None else self.handle,
                kvikio=reader,
            )
        self._index = 0
        self._failed: str | None = None

    @property
    def pinned_bytes(self) -> int:
        """Host memory pinned for the weights' ring (the staged path's staging buffers, or the CPU ring's)."""
        if isinstance(self._ring, DeviceRing):
            return self._ring.pinned_bytes
        return sum(b.capacity for b in self._ring.buffers if b.pinned) if self._ring is not None else 0

    @property
    def staging_bytes(self) -> int:
        """Host staging buffers between disk and device (the staged path), pinned or not."""
        return self._ring.staging_bytes if isinstance(self._ring, DeviceRing) else 0

    @property
    def stats(self) -> ReadStats:
        return self._ring.stats if self._ring is not None else ReadStats()

    def _groups(self) -> Generator[dict[str, torch.Tensor], None, None]:
        """Each streamed group's tensors in order; the buffer goes back to the ring when the next is asked for."""
        ring = self._ring
        for g in self.plan.streamed:
            assert ring is not None
            buf = ring.take(self._index)
            self._index = (self._index + 1) % len(self.plan.streamed)
            try:
                yield ring.views(buf, g, self.dtype)  # type: ignore[arg-type]
            finally:
                ring.release(buf)  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward(self, step: Step) -> torch.Tensor:
        """Logits [B, T, vocab] of ``step``'s tokens (the cache in ``step`` is filled as it goes).

        A pass that fails leaves the ring mid-cycle: later passes are refused, naming the first error."""
        if self._failed is not None:
            raise InferenceError(f"the executor stopped after an earlier error: {self._failed}")
        groups = self._groups()
        try:
            w = next(groups) if self._streams_pre else self.resident
            h = self.model.embed(w, step).to(self.dtype)
            for i in range(self.model.n_layers):
                h = self.model.layer(i, self.resident if i in self._pinned else next(groups), h, step)
            w = next(groups) if self._streams_pre else self.resident
            return self.model.head(w, h)
        except BaseException as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            groups.close()

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
        self.handle.close()

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
