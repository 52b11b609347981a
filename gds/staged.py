"""The staged path: file <-> pinned host staging buffers <-> device, overlapped.

Without GPUDirect, bytes must cross host memory. Two page-aligned staging
buffers (pinned when CUDA exists, so copies are truly asynchronous) take turns:

* read:  aio fills buffer A from the file while the device copy of buffer B,
         issued ``non_blocking`` on a side CUDA stream, is still running;
* write: the device-to-host copy of the next chunk runs while the previous
         chunk is handed to aio's ``FileWriter``.

Tensors on the CPU go through exactly the same pipeline (the "device copy" is
then a plain memcpy). That costs one extra host copy for CPU tensors - use
``aio`` directly when you only have host memory - but it means a machine
without a GPU runs and tests every line of the chunking logic.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading

import torch

from aio import AioHandle, AlignedBuffer
from aio.buffers import round_up

MIB = 1 << 20
DEFAULT_STAGING_BYTES = 64 * MIB


def check_staging_bytes(staging_bytes: int, alignment: int) -> int:
    """``staging_bytes`` as an int rounded up to ``alignment``; TypeError/ValueError naming it when unusable.

    Checked when a handle is built, so a bad value fails there rather than in every transfer.
    """
    try:
        size = operator.index(staging_bytes)  # ints and numpy integers; not floats, None or strings
    except TypeError:
        raise TypeError(
            f"staging_bytes must be an integer, got {type(staging_bytes).__name__} {staging_bytes!r}"
        ) from None
    if size < alignment:
        raise ValueError(f"staging_bytes must be >= {alignment} (the aio alignment), got {size}")
    return round_up(size, alignment)


class _DeviceCopier:
    """Copies between staging and the tensor's device; async on a side stream for CUDA.

    Each staging slot has an event so that a slot is reused only once the copy
    that last touched it has finished.
    """

    def __init__(self, device: torch.device, stream: "torch.cuda.Stream | None") -> None:
        self.device = device
        self.stream = stream
        self.events = [torch.cuda.Event(), torch.cuda.Event()] if stream is not None else []
        if stream is not None:
            # Work already queued on the caller's stream (the kernels that produced
            # the tensor, or its allocation) must precede our copies.
            stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, slot: int) -> None:
        if self.stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            self.events[slot].record(self.stream)

    def wait(self, slot: int) -> None:
        """Block until the last copy through ``slot`` is done (no-op when none was issued)."""
        if self.stream is not None:
            self.events[slot].synchronize()

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class StagedPath:
    """Moves tensor bytes through aio and two reusable staging buffers.

    One transfer at a time per instance (a lock serialises callers); use
    several handles for concurrent transfers.
    """

    def __init__(self, io: AioHandle, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.io = io
        self.staging_bytes = check_staging_bytes(staging_bytes, io.config.alignment)
        self._buffers: list[AlignedBuffer] = []
        self._views: list[torch.Tensor] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    @property
    def pinned(self) -> bool | None:
        """Whether the staging buffers are pinned (None before the first transfer)."""
        return self._buffers[0].pinned if self._buffers else None

    def close(self) -> None:
        with self._lock:
            self._buffers, self._views = [], []
            self._streams.clear()

    # -- the two pipelines ------------------------------------------------------------
    def write(self, path: str | os.PathLike[str], src: torch.Tensor, *, fsync: bool | None) -> int:
        """Write the flat uint8 tensor ``src`` (any device) as the whole file ``path``."""
        nbytes = src.numel()
        with self._lock, self._device_ctx(src.device):
            copier = self._copier(src.device)
            stage = self._staging(nbytes)
            chunks = self._chunks(nbytes)
            with self.io.writer(path, size_hint=nbytes, fsync=fsync) as w:
                try:
                    if chunks:
                        start, n = chunks[0]
                        copier.copy(stage[0][:n], src[start : start + n], 0)
                    for i, (_, n) in enumerate(chunks):
                        if i + 1 < len(chunks):  # next device-to-host copy overlaps this chunk's write
                            nstart, nn = chunks[i + 1]
                            copier.copy(stage[(i + 1) % 2][:nn], src[nstart : nstart + nn], (i + 1) % 2)
                        copier.wait(i % 2)
                        # write() returns only once it no longer reads our buffer, so the
                        # buffer may be refilled two chunks from now.
                        w.write(self._buffers[i % 2].view(n))
                finally:
                    copier.finish()
            return w.size

    def read_into(self, path: str | os.PathLike[str], dst: torch.Tensor, offset: int) -> int:
        """Fill the flat uint8 tensor ``dst`` (any device) from ``path`` at ``offset``."""
        nbytes = dst.numel()
        with self._lock, self._device_ctx(dst.device):
            copier = self._copier(dst.device)
            stage = self._staging(nbytes)
            try:
                for i, (start, n) in enumerate(self._chunks(nbytes)):
                    slot = i % 2
                    copier.wait(slot)  # the copy out of this buffer two chunks ago
                    self.io.read_into(path, offset + start, self._buffers[slot].view(n))
                    copier.copy(dst[start : start + n], stage[slot][:n], slot)
            finally:
                copier.finish()
        return nbytes

    # -- helpers ----------------------------------------------------------------------
    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        step = self.staging_bytes
        return [(s, min(step, nbytes - s)) for s in range(0, nbytes, step)]

    def _staging(self, nbytes: int) -> list[torch.Tensor]:
        """Two staging buffers holding at least min(nbytes, staging_bytes); grown on demand."""
        need = min(round_up(max(nbytes, 1), self.io.config.alignment), self.staging_bytes)
        if not self._buffers or self._buffers[0].capacity < need:
            self._buffers = [AlignedBuffer(need), AlignedBuffer(need)]
            self._views = [b.tensor(b.capacity) for b in self._buffers]
        return self._views

    def _copier(self, device: torch.device) -> _DeviceCopier:
        if device.type != "cuda":
            return _DeviceCopier(device, None)
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return _DeviceCopier(device, self._streams[device])

    @staticmethod
    def _device_ctx(device: torch.device) -> contextlib.AbstractContextManager[object]:
        """Make the tensor's GPU current, so streams and events are created on it."""
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
