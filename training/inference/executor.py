"""The streaming executor: weights stay on disk and pass through a reused, aligned ring within a budget.

A forward pass visits the model's groups in order: ``pre`` (embedding), every layer, ``post`` (final
norm and head). Weights kept *resident* are read once; the others are *streamed* every pass, in the
cyclic order the passes consume them (the last layer of one pass is followed by the first of the
next), by reader threads that run ahead of compute as far as the ring allows. Reads are O_DIRECT
through :mod:`aio` (libaio where present) into page-aligned, pre-faulted buffers that are never freed
or re-faulted, so weights do not pass through the page cache and the process's resident memory stays
at ring + resident tensors.

How the budget is spent is :mod:`training.inference.plan`'s. On the ``cpu`` read path streaming is at
the *tensor grain*: a layer arrives as parts (its :meth:`StreamModel.layer_stages`: a projection with
its bias, a norm with the projection after it) read into one circular arena (:class:`_Arena`), and
the model gets a mapping (:class:`_StagedWeights`) that waits for a part when it first reads one of its
weights and releases the earlier parts then, so the arena only has to hold a few parts (the largest
projection twice, or ``RING_TARGET`` bytes in flight) and the rest of the budget keeps individual layer
tensors resident: fewer bytes read per token than a ring of whole layers leaves room for. At batch 1
a pass is bound by the disk: it streams at least ``weights - (budget - ring)`` bytes, and decode
tokens/s is at most the disk's read rate divided by that (docs/inference.md works it out).

On a device (``staged``, ``gds``: :mod:`training.inference.device`) streaming stays at the *layer
grain*: a ring of whole-layer buffers in device memory (which the budget then counts), whole layers
pinned with the rest.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch

from aio import AioConfig, AlignedBuffer
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
from training.inference.errors import InferenceError
from training.inference.files import RangeReader
from training.inference.layout import FileSizes, GroupLayout, Placed, join_layouts, layout_group
from training.inference.model import Step, StreamModel
from training.inference.plan import POST, PRE, plan_layers, plan_tensors
from training.inference.sources import TensorSource, WeightSource
from ucp.format.dtypes import itemsize, torch_dtype

READ_CONFIG = AioConfig(block_size=4 << 20, queue_depth=32)  # few staging blocks: aligned spans read direct
ARENA_READERS = 4  # reader threads of the arena on local files: several parts in flight, the queue full across parts


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


def tensor_views(
    buf: AlignedBuffer, placed: list[Placed], dtype: torch.dtype, base: int = 0
) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buf`` from byte ``base`` (no copy when already in ``dtype`` and element-aligned)."""
    return placed_views(placed, dtype, lambda p: torch.frombuffer(buf.view(p.nbytes, base + p.at), dtype=torch.uint8))


class _Arena:
    """The tensor-grain ring: one aligned buffer that parts pass through in order, as a circular log.

    Reader threads take the next part (counted over passes), place it after the last one placed (at
    the buffer's start when it would run past the end) and read it once compute has released every
    earlier part whose bytes it overwrites. Compute takes parts in order and releases them in order,
    so the bytes a part may reuse are always those of the oldest parts: whatever the buffer does not
    hold for compute is in flight, and a part no larger than the buffer is always placed."""

    def __init__(
        self,
        parts: list[GroupLayout],
        nbytes: int,
        handle: RangeReader,
        readers: int = ARENA_READERS,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max(p.nbytes for p in parts) > nbytes:
            raise ValueError(f"a ring of {nbytes} bytes cannot hold a part of {max(p.nbytes for p in parts)}")
        self.parts, self.handle, self.nbytes, self.dtype, self.stats = parts, handle, nbytes, dtype, ReadStats()
        self.buffer = AlignedBuffer(nbytes, pin=None)
        self._cond = threading.Condition()
        self._stop = False
        self._next = 0  # the next part (counted over passes) a reader places
        self._end = 0  # where the last placed part ends, counted in bytes written since the start
        self._place: dict[int, tuple[int, int]] = {}  # part -> (start, end), until released
        self._freed = 0  # where the last released part ends
        self._done: dict[int, BaseException | None] = {}
        self._taken = self._released = 0  # the next part compute takes; the next it releases
        self._active, self._busy_since = 0, 0.0
        self._threads = [
            threading.Thread(target=self._run, name=f"ucp-infer-reader-{n}", daemon=True)
            for n in range(max(1, readers))
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                k, self._next = self._next, self._next + 1
                part = self.parts[k % len(self.parts)]
                start = self._end
                if start % self.nbytes + part.nbytes > self.nbytes:
                    start += self.nbytes - start % self.nbytes  # wrap to the buffer's start
                # the bytes it overwrites last held data ending by ``need``: every part up to there released
                need, self._end = min(start + part.nbytes - self.nbytes, self._end), start + part.nbytes
                self._place[k] = (start, self._end)
                while not self._stop and self._freed < need:
                    self._cond.wait()
                if self._stop:
                    return
                if self._active == 0:
                    self._busy_since = time.perf_counter()
                self._active += 1
            error: BaseException | None = None
            try:
                load_group(self.handle, part, self.buffer, start % self.nbytes)
            except BaseException as exc:  # noqa: BLE001 - handed to the compute thread
                error = exc
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self.stats.read_seconds += time.perf_counter() - self._busy_since
                if error is None:
                    self.stats.bytes_read += part.read_bytes
                    self.stats.groups_read += 1
                self._done[k] = error
                self._cond.notify_all()
            if error is not None:
                return

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes of the arena (none on the CPU path: it is made with ``pin=None``, pinned only where a
        GPU exists)."""
        return self.buffer.capacity if self.buffer.pinned else 0

    def take(self, index: int) -> dict[str, torch.Tensor]:
        """Views of part ``index`` (of a pass), the next in order, once it is read."""
        t0 = time.perf_counter()
        with self._cond:
            while self._taken not in self._done:
                self._cond.wait()
            k = self._taken
            exc = self._done.pop(k)
            self._taken += 1
            if self._active:
                now = time.perf_counter()
                self.stats.read_seconds += now - self._busy_since
                self._busy_since = now
            base = self._place[k][0] % self.nbytes
        self.stats.wait_seconds += time.perf_counter() - t0
        if exc is not None:
            raise exc
        got = k % len(self.parts)
        assert got == index, f"ring out of order: got part {got}, wanted {index}"
        return tensor_views(self.buffer, self.parts[got].tensors, self.dtype, base)

    def release(self) -> None:
        """Give back the oldest part taken: its bytes may be read over."""
        with self._cond:
            assert self._released < self._taken, "released a part not taken"
            self._freed = self._place.pop(self._released)[1]
            self._released += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()


class _StagedWeights(Mapping[str, torch.Tensor]):
    """One group's weights while it computes: its resident ones, and its streamed parts (stages) taken
    from the arena in order as the model first asks for a weight of each. Asking for a later stage
    releases the earlier ones (the model is done with them: :meth:`StreamModel.layer_stages`); asking
    again for a released weight is an error rather than a read of bytes the ring reused."""

    def __init__(
        self, arena: _Arena, first: int, parts: list[GroupLayout], resident: Mapping[str, torch.Tensor], label: str
    ) -> None:
        self._arena, self._first, self._parts, self._resident, self._label = arena, first, parts, resident, label
        self._where = {t.name: j for j, p in enumerate(parts) for t in p.tensors}
        self._views: dict[str, torch.Tensor] = {}
        self._taken = self._released = 0

    def _advance(self, j: int) -> None:
        """Release what is held, then take parts up to ``j`` (those before it released unused)."""
        while self._released < self._taken:
            self._release_one()
        while self._taken <= j:
            self._views = self._arena.take(self._first + self._taken)
            self._taken += 1
            if self._taken <= j:
                self._release_one()

    def _release_one(self) -> None:
        self._views = {}
        self._arena.release()
        self._released += 1

    def __getitem__(self, name: str) -> torch.Tensor:
        j = self._where.get(name)
        if j is None:
            return self._resident[name]
        if j < self._released:
            raise InferenceError(
                f"{self._label}: the model read {name!r} again after weights of a later stage, whose reads reuse "
                "its memory: its layer_stages do not match the order its layer reads weights"
            )
        if j >= self._taken:
            self._advance(j)
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def finish(self) -> None:
        """Take the parts the model did not ask for (the ring hands them over in order), release all."""
        if self._taken < len(self._parts):
            self._advance(len(self._parts) - 1)
        while self._released < self._taken:
            self._release_one()


def held_bytes(tensors: Sequence[Placed | TensorSource], dtype: torch.dtype, as_read: int | None = None) -> int:
    """Memory ``tensors`` take resident in compute ``dtype``: floating tensors converted to it. When
    none needs converting and ``as_read`` is given, the buffer they were read into (its views keep it)."""
    size = torch.empty((), dtype=dtype).element_size()
    floats = [torch_dtype(t.dtype).is_floating_point for t in tensors]
    if as_read is not None and all(torch_dtype(t.dtype) == dtype for t, f in zip(tensors, floats) if f):
        return as_read
    return sum((t.nbytes // itemsize(t.dtype)) * (size if f else itemsize(t.dtype)) for t, f in zip(tensors, floats))


def load_group(handle: RangeReader, g: GroupLayout, buf: AlignedBuffer, base: int = 0) -> None:
    """Read every range of ``g`` into ``buf`` from byte ``base`` on (all ranges of a file in flight
    together): through ``aio`` for local files, ranged GETs for an object store's
    (:mod:`training.inference.files`)."""
    for file, reads in g.reads.items():
        handle.read_ranges(file, [(off, buf.view(n, base + at)) for off, at, n in reads])


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
        pre = layout_group(PRE, model.pre_names(), source, sizes)
        layers = [layout_group(f"layer {i}", model.layer_names(i), source, sizes) for i in range(model.n_layers)]
        post = layout_group(POST, model.post_names(), source, sizes)
        unique = {t.name: t for t in (*pre.tensors, *post.tensors)}
        resident_bytes = held_bytes(list(unique.values()), dtype)
        one: dict[str, GroupLayout] = {}  # each tensor's own layout (the tensor grain's unit of placement)
        if self.read_path == "cpu":
            one = {n: layout_group(n, [n], source, sizes) for n in dict.fromkeys(model.expected_shapes())}

            def staged(stages: list[list[str]]) -> list[list[GroupLayout]]:
                return [[one[n] for n in st] for st in stages]

            for i in range(model.n_layers):
                if [n for st in model.layer_stages(i) for n in st] != model.layer_names(i):
                    raise InferenceError(f"layer {i}: the model's layer_stages do not list its layer_names in order")
            self.plan = plan_tensors(
                staged([model.pre_names()]),
                [staged(model.layer_stages(i)) for i in range(model.n_layers)],
                staged([model.post_names()]),
                budget,
                edge_bytes=resident_bytes,
                held={n: held_bytes(g.tensors, dtype, g.nbytes) for n, g in one.items()},
                prefetch=prefetch,
                pin=pin_layers,
            )
        else:
            self.plan = plan_layers(
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
            batches = [pre, layout_group(post.label, rest, source, sizes)]
            if self.plan.grain == "layer":
                batches += [layers[i] for i in self.plan.pinned]
            else:  # resident layer tensors, read a layer's worth at a time
                chosen = set(self.plan.pinned_tensors)
                for i in range(model.n_layers):
                    mine = [one[n] for n in model.layer_names(i) if n in chosen]
                    if mine:
                        batches.append(join_layouts(f"layer {i}", mine))
            for g in batches:
                buf = AlignedBuffer(g.nbytes)
                load_group(self.handle, g, buf)
                self.resident_stats.bytes_read += g.read_bytes
                # views keep ``buf`` alive where no conversion copied them; converted ones let it go
                views = tensor_views(buf, g.tensors, dtype)
                self.resident.update({n: t.to(self.device) for n, t in views.items()})
                del buf, views
            self.resident_stats.read_seconds = time.perf_counter() - t0
        # the groups a pass visits, in order, and where each one's streamed units start in ``plan.units``
        self._labels = [PRE, *(g.label for g in layers), POST]
        self._streamed_at: dict[str, tuple[int, int]] = {}
        for u, gi in enumerate(self.plan.unit_group):
            label = self.plan.streamed[gi].label
            start, count = self._streamed_at.get(label, (u, 0))
            self._streamed_at[label] = (start, count + 1)
        self.lane = Lane(self.device)
        self._ring: _Arena | DeviceRing | None = None
        if self.plan.streamed and self.read_path == "cpu":
            readers = 1 if source.files.remote else ARENA_READERS  # an object store's client: one thread
            self._ring = _Arena(self.plan.units, self.plan.arena_bytes, self.handle, readers, dtype)
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
        self._failed: str | None = None

    @property
    def pinned_bytes(self) -> int:
        """Host memory pinned for the weights' ring (the staged path's staging buffers, or the CPU ring's)."""
        return self._ring.pinned_bytes if self._ring is not None else 0

    @property
    def staging_bytes(self) -> int:
        """Host staging buffers between disk and device (the staged path), pinned or not."""
        return self._ring.staging_bytes if isinstance(self._ring, DeviceRing) else 0

    @property
    def stats(self) -> ReadStats:
        return self._ring.stats if self._ring is not None else ReadStats()

    @contextmanager
    def _weights(self, label: str) -> Iterator[Mapping[str, torch.Tensor]]:
        """Group ``label``'s weights while it computes: the resident ones, or its streamed units from the ring
        (handed back when the group is done)."""
        where = self._streamed_at.get(label)
        ring = self._ring
        if where is None:
            yield self.resident
            return
        first, count = where
        if isinstance(ring, _Arena):
            w = _StagedWeights(ring, first, self.plan.units[first : first + count], self.resident, label)
            yield w
            w.finish()  # not on an error: the executor refuses further passes, and later parts may never come
            return
        assert ring is not None
        buf = ring.take(first)
        try:
            yield ring.views(buf, self.plan.units[first], self.dtype)
        finally:
            ring.release(buf)

    @torch.inference_mode()
    def forward(self, step: Step) -> torch.Tensor:
        """Logits [B, T, vocab] of ``step``'s tokens (the cache in ``step`` is filled as it goes).

        A pass that fails leaves the ring mid-cycle: later passes are refused, naming the first error."""
        if self._failed is not None:
            raise InferenceError(f"the executor stopped after an earlier error: {self._failed}")
        try:
            with self._weights(PRE) as w:
                h = self.model.embed(w, step).to(self.dtype)
            for i in range(self.model.n_layers):
                with self._weights(self._labels[i + 1]) as w:
                    h = self.model.layer(i, w, h, step)
            with self._weights(POST) as w:
                return self.model.head(w, h)
        except BaseException as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            raise

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
        self.handle.close()

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
