"""Where compute runs and how streamed weights reach it: the ``cpu``, ``staged`` and ``gds`` read paths.

* ``cpu``: the executor's host arena (:class:`~training.inference.executor._Arena`, the tensor grain); compute
  views it.
* ``staged``: a reader thread fills page-aligned host buffers (pinned when CUDA is present) with
  O_DIRECT reads, then copies each into a ring of *device* buffers ``non_blocking`` on a dedicated
  copy stream, recording an event per copy; compute waits on that event (on its own stream, not the
  host) and records an event when it is done with a buffer, which the copy stream waits on before
  overwriting it. So layer ``i`` computes while layer ``i+1`` is copied and ``i+2`` is read.
* ``gds``: KvikIO reads each group's ranges straight into the device buffer (GPUDirect Storage, or
  KvikIO's POSIX compatibility path), no host staging; KvikIO works outside stream order, so the
  reader waits on the host for compute to release a buffer before refilling it.

The same code serves a CPU "device": a :class:`Lane` without CUDA has no stream and its events are
no-ops (CPU copies are synchronous), so CI runs every line of the staged ring except the CUDA calls
(and the gds ring, with a stand-in for KvikIO's file object).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from typing import Any, Callable, Literal

import torch

from aio import AlignedBuffer
from training.inference.errors import InferenceError
from training.inference.files import RangeReader
from training.inference.layout import GroupLayout, Placed
from ucp.format.dtypes import itemsize, torch_dtype

ReadPath = Literal["cpu", "staged", "gds"]
READ_PATHS = ("auto", "cpu", "staged", "gds")
GDS_EXTRA = "pip install 'ucp[gds]' (installs kvikio-cu12)"


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device this process can compute on; InferenceError naming it otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InferenceError(f"device {device!r} is not a device name (cpu, cuda, cuda:N): {exc}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InferenceError(f"device {str(dev)!r} is not supported for inference (cpu, cuda, cuda:N)")
    import gds

    caps = gds.capabilities()
    if not caps.cuda_available:
        why = "; ".join(r for r in caps.reasons if not r.startswith("auto uses") and "kvikio" not in r)
        raise InferenceError(f"device {str(dev)!r} asked for, but CUDA is not usable in this process: {why}")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= caps.device_count:
        raise InferenceError(f"device {str(dev)!r} asked for, but this process sees {caps.device_count} GPU(s)")
    return torch.device("cuda", index)


def choose_read_path(device: torch.device, requested: str | None, caps: Any) -> ReadPath:
    """The read path for ``device``: ``auto`` (None) is ``cpu`` on the CPU, ``gds`` on a GPU when KvikIO
    imports, else ``staged``. ``staged`` runs on any device (on the CPU: the staged ring's test path);
    ``cpu`` needs the CPU, ``gds`` a GPU and KvikIO (the ``gds`` extra). ``caps``: gds's CapabilityReport."""
    req = requested or "auto"
    if req not in READ_PATHS:
        raise InferenceError(f"read path {req!r} is not one of {', '.join(READ_PATHS)}")
    if req == "auto":
        if device.type == "cpu":
            return "cpu"
        return "gds" if caps.kvikio_importable else "staged"
    if req == "cpu" and device.type != "cpu":
        raise InferenceError(f"read path 'cpu' computes on the CPU, but device {str(device)!r} was asked for")
    if req == "gds":
        if device.type != "cuda":
            raise InferenceError(
                f"read path 'gds' reads weights into GPU memory, but device {str(device)!r} was asked for "
                "(use --device cuda)"
            )
        if not caps.kvikio_importable:
            raise InferenceError(
                f"read path 'gds' needs KvikIO, which is not importable here ({caps.kvikio_error}): "
                f"install the 'gds' extra, {GDS_EXTRA}"
            )
    return req  # type: ignore[return-value]


def probe_kvikio_read(file: str, device: torch.device, kvikio: Any = None) -> str | None:
    """None when KvikIO reads the first bytes of ``file`` into ``device`` memory (GDS or its compatibility
    path), else why not: ``auto`` then takes the staged path rather than fail mid-run."""
    try:
        reader = KvikioReader(kvikio)
        n = min(4096, os.path.getsize(file))
        g = GroupLayout("probe", [], {file: [(0, 0, n)]}, [], 4096)
        try:
            reader.read_group(g, torch.empty(4096, dtype=torch.uint8, device=device))
        finally:
            reader.close()
    except Exception as exc:  # noqa: BLE001 - any failure means: not this path
        return f"{type(exc).__name__}: {exc}"
    return None


class Marker:
    """A point in a CUDA stream's work (an event), or nothing on the CPU, where work is synchronous."""

    def __init__(self, event: "torch.cuda.Event | None" = None) -> None:
        self.event = event

    def synchronize(self) -> None:
        """Block the calling thread until the work before the marker is done."""
        if self.event is not None:
            self.event.synchronize()


DONE = Marker()


class Lane:
    """A dedicated copy stream on ``device`` and the events that order it against compute; on the CPU
    a stream-less stand-in whose copies are plain synchronous copies and whose markers are no-ops."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def context(self) -> contextlib.AbstractContextManager[object]:
        """Enter in a thread that issues copies: makes the device current there."""
        return torch.cuda.device(self.device) if self.stream is not None else contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Marker = DONE) -> Marker:
        """Copy ``src`` into ``dst`` on the copy stream once ``after`` is reached; the marker of its end."""
        if self.stream is None:
            dst.copy_(src)
            return DONE
        if after.event is not None:
            self.stream.wait_event(after.event)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return Marker(ev)

    def compute_marker(self) -> Marker:
        """A marker at the end of the work queued so far on the compute (current) stream."""
        if self.stream is None:
            return DONE
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return Marker(ev)

    def compute_waits(self, marker: Marker) -> None:
        """Make the compute stream wait for ``marker`` (the host does not block)."""
        if marker.event is not None:
            torch.cuda.current_stream(self.device).wait_event(marker.event)


def placed_views(
    placed: list[Placed],
    dtype: torch.dtype,
    raw_bytes: Callable[[Placed], torch.Tensor],
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Each placed tensor as a view of its bytes (``raw_bytes(p)``: a uint8 tensor of ``p.nbytes``), copied
    only where element-misaligned; floating ones converted to ``dtype``; empty ones made on ``device``.
    The device ring (:func:`flat_views`) and the host ring (``executor.tensor_views``) both build with this."""
    out = {}
    for p in placed:
        if p.nbytes == 0:
            out[p.name] = torch.empty(p.shape, dtype=torch_dtype(p.dtype), device=device)
            continue
        raw = raw_bytes(p)
        if p.at % itemsize(p.dtype):  # an element-misaligned offset in the file: copy to an aligned tensor
            raw = raw.clone()
        t = raw.view(torch_dtype(p.dtype)).view(p.shape)
        out[p.name] = t if t.dtype == dtype or not t.is_floating_point() else t.to(dtype)
    return out


def flat_views(flat: torch.Tensor, placed: list[Placed], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors viewing the flat uint8 ``flat`` (any device); floating ones converted to ``dtype``."""
    return placed_views(placed, dtype, lambda p: flat[p.at : p.at + p.nbytes], device=flat.device)


class KvikioReader:
    """Reads a group's ranges straight into a device buffer through ``kvikio.CuFile`` (files kept open)."""

    def __init__(self, kvikio: Any = None) -> None:
        if kvikio is None:
            import kvikio as module

            kvikio = module
        self._kvikio = kvikio
        self._files: dict[str, Any] = {}

    def read_group(self, g: GroupLayout, dst: torch.Tensor) -> None:
        """Every range of ``g`` into the flat uint8 ``dst``, all in flight together; a short read is an error."""
        pending = []
        for file, reads in g.reads.items():
            f = self._files.get(file)
            if f is None:
                f = self._files[file] = self._kvikio.CuFile(file, "r")
            for off, at, n in reads:
                pending.append((file, off, n, f.pread(dst[at : at + n], n, off)))
        for file, off, n, fut in pending:
            done = fut.get()
            if done != n:
                raise InferenceError(f"{file}: KvikIO read {done} of {n} bytes at offset {off}")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class DeviceRing:
    """Streamed groups in a ring of ``slots`` device buffers, filled ahead of compute by a reader thread:
    through two host staging buffers and ``lane``'s copy stream (``staged``), or by ``kvikio`` (``gds``).

    ``take(i)`` hands compute the buffer of group ``i`` (its copy ordered before compute's next work);
    ``release`` gives it back with a marker of compute's use, which the next fill waits for.
    """

    def __init__(
        self,
        groups: list[GroupLayout],
        slots: int,
        slot_bytes: int,
        lane: Lane,
        *,
        handle: RangeReader | None = None,
        kvikio: KvikioReader | None = None,
    ) -> None:
        from training.inference.executor import ReadStats, load_group

        if (handle is None) == (kvikio is None):
            raise ValueError("DeviceRing reads through exactly one of an aio handle (staged) or KvikIO (gds)")
        self._load = load_group
        self.groups, self.lane, self.handle, self.kvikio = groups, lane, handle, kvikio
        self.stats = ReadStats()
        dev = lane.device
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=dev) for _ in range(slots)]
        self.staging = [] if kvikio is not None else [AlignedBuffer(slot_bytes) for _ in range(min(2, len(groups)))]
        self._staged: list[Marker] = [DONE for _ in self.staging]  # the copy last made out of each staging buffer
        self._free: queue.Queue[tuple[int, Marker] | None] = queue.Queue()
        self._ready: queue.Queue[tuple[int, int, Marker, BaseException | None]] = queue.Queue()
        for b in range(slots):
            self._free.put((b, DONE))
        self._thread = threading.Thread(target=self._run, name="ucp-infer-device-reader", daemon=True)
        self._thread.start()

    @property
    def pinned_bytes(self) -> int:
        return sum(b.capacity for b in self.staging if b.pinned)

    @property
    def staging_bytes(self) -> int:
        return sum(b.capacity for b in self.staging)

    def _run(self) -> None:
        with self.lane.context():
            i = 0
            while True:
                item = self._free.get()
                if item is None:
                    return
                slot, released = item
                index = i % len(self.groups)
                g = self.groups[index]
                t0 = time.perf_counter()
                try:
                    marker = self._fill(g, self.buffers[slot], released, i)
                except BaseException as exc:  # noqa: BLE001 - handed to the compute thread
                    self._ready.put((index, slot, DONE, exc))
                    return
                self.stats.read_seconds += time.perf_counter() - t0
                self.stats.bytes_read += g.read_bytes
                self.stats.groups_read += 1
                self._ready.put((index, slot, marker, None))
                i += 1

    def _fill(self, g: GroupLayout, dst: torch.Tensor, released: Marker, i: int) -> Marker:
        if self.kvikio is not None:
            released.synchronize()  # KvikIO writes outside stream order: compute must be done with dst
            self.kvikio.read_group(g, dst)
            return DONE
        assert self.handle is not None
        k = i % len(self.staging)
        host = self.staging[k]
        self._staged[k].synchronize()  # the copy out of this staging buffer two groups ago
        self._load(self.handle, g, host)
        n = g.nbytes
        self._staged[k] = self.lane.copy(dst[:n], host.tensor(n), after=released)
        return self._staged[k]

    def take(self, index: int) -> int:
        """The slot holding group ``index``; compute's stream is ordered after its copy."""
        t0 = time.perf_counter()
        got, slot, marker, exc = self._ready.get()
        self.stats.wait_seconds += time.perf_counter() - t0
        if exc is not None:
            raise exc
        assert got == index, f"ring out of order: got group {got}, wanted {index}"
        self.lane.compute_waits(marker)
        return slot

    def views(self, slot: int, g: GroupLayout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return flat_views(self.buffers[slot], g.tensors, dtype)

    def release(self, slot: int) -> None:
        self._free.put((slot, self.lane.compute_marker()))

    def close(self) -> None:
        self._free.put(None)
        self._thread.join()
        for m in self._staged:
            m.synchronize()
        if self.kvikio is not None:
            self.kvikio.close()
