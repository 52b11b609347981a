"""How an engine's checkpoint is saved with the optimizer's state where it lives, and the saves still reading it.

Both engines (:class:`training.Engine`, :class:`training.ModuleEngine`) hand one :class:`InFlightSaves` a function
that builds their state dict and one that writes it (a manager's ``save``, ``ucp.save`` or an
:class:`ucp.AsyncSaver`'s ``save``); it picks how the offloaded state gets there:

* a synchronous save with an offload tier: the optimizer's states (and, ``offload_param`` nvme, the parameters)
  are streamed from the swap files while the save writes them (:class:`training.offload.checkpoint.TierReader`,
  :func:`~training.offload.checkpoint.streamed_params`), never all in memory;
* an asynchronous save with a tier on NVMe: the same, from a *copy* of the swap files
  (:class:`~training.offload.checkpoint.TierCopy`, :class:`~training.offload.params.ParamCopy`) made behind the
  next forward and backward, since training rewrites the originals meanwhile; the tiers must not be written before
  the copies are made (:meth:`InFlightSaves.wait_snapshot`), and the copies are removed once the save is done;
* otherwise the state is in memory (or staged from a CPU tier) and the saver snapshots it as any state.

The engines call :meth:`InFlightSaves.wait_snapshot` before their weights change (the optimizer step, or the
update armed to run during backward) and :meth:`InFlightSaves.close` before their tiers go away.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import ucp

from .offload.checkpoint import TierCopy, TierReader
from .offload.params import ParamCopy
from .offload.store import NvmeStore
from .zero import ZeroOptimizer

StateBuilder = Callable[[TierReader | None, bool | ParamCopy], dict[str, Any]]
"""``(streamed, stream_params) -> state dict``: the engine's ``state_dict_for_checkpoint``, with the optimizer's
states read by ``streamed`` (None: in memory, or staged from the tier) and the parameters streamed from their swap
files (True) or from that copy of them (a ParamCopy)."""
Writer = Callable[[dict[str, Any]], ucp.Manifest | ucp.SaveHandle]


class InFlightSaves:
    """One engine's checkpoint saves: how each reads the optimizer's state, and the asynchronous ones still reading
    the live state (the snapshot of the last one) or a copy of the swap files (every streamed one until it is done).
    Not thread-safe: the engine's training thread calls it.

    It holds a streamed save's handle only to bound the copies on the swap device and to keep the tiers until the
    save is done reading them; reporting a save's outcome (and naming it in ``latest``) is the engine's, which tracks
    every asynchronous save, streamed or not (``ModuleEngine._decoupled``)."""

    def __init__(self, optimizer: ZeroOptimizer) -> None:
        self.optimizer = optimizer
        self.snapshot: ucp.SaveHandle | None = None  # the last asynchronous save, whose copy may still run
        self.copies: list[TierCopy | ParamCopy] = []  # ... and the copies of the tiers' swap files it streams
        self.streaming: list[_Streamed] = []  # asynchronous saves that may still read such a copy
        self.last_io: dict[str, int] = {}  # a synchronous save streamed from the optimizer's tier: what it read

    def streams_async(self, saver: ucp.AsyncSaver | None) -> bool:
        """Whether an asynchronous save through ``saver`` streams copies of the swap files (an NVMe tier, of the
        optimizer's states or of the parameters): its writer thread reads them through the copies' readers, a
        writer process reads the files itself (the StreamedShards' sources)."""
        offload = self.optimizer.offload
        nvme = offload is not None and isinstance(offload.store, NvmeStore)
        return (nvme or self.optimizer.param_tier is not None) and saver is not None

    def save(self, state: StateBuilder, write: Writer, saver: ucp.AsyncSaver | None) -> ucp.Manifest | ucp.SaveHandle:
        """Build the state dict the way ``saver`` needs it (None: ``write`` saves synchronously) and ``write`` it.

        Waits for the previous asynchronous save's snapshot first. An asynchronous save returns its handle once
        the state is snapshotted (or, streamed, once the copies of the swap files are started): call
        :meth:`wait_snapshot` before the weights or the tiers change. Streamed asynchronous saves take no staging
        arena of the state's size, so ``saver.options.max_in_flight`` bounds them here (and the copies on the swap
        device with them): the oldest is waited for (its failure is the save's to report, not raised here)."""
        self.wait_snapshot()
        offload, params = self.optimizer.offload, self.optimizer.param_tier
        self.last_io = {}
        try:
            if saver is None and (offload is not None or params is not None):  # streamed from the tiers
                if params is not None:
                    params.quiesce()
                with TierReader(offload) if offload is not None else contextlib.nullcontext() as reader:
                    result = write(state(reader, params is not None))
                if reader is not None:
                    self.last_io = {"bytes_read": reader.bytes_read, "buffer_bytes": reader.buffer_bytes}
            elif self.streams_async(saver):
                assert saver is not None
                result = self._save_streamed(state, write, saver)
            else:  # nothing offloaded to NVMe: the state is in memory, staged as any
                result = write(state(None, False))
        finally:
            self.optimizer.drop_staged()  # offloaded state staged for the save (the save holds what it needs)
        if isinstance(result, ucp.SaveHandle):
            self.snapshot = result
        return result

    def _save_streamed(self, state: StateBuilder, write: Writer, saver: ucp.AsyncSaver) -> ucp.SaveHandle:
        """Asynchronous, still streamed: the writer (thread or process) reads copies of the swap files (TierCopy,
        ParamCopy), made behind the next forward and backward; the tiers are not written before they are."""
        offload, params = self.optimizer.offload, self.optimizer.param_tier
        self.release_done()
        while len(self.streaming) >= saver.options.max_in_flight:
            oldest = self.streaming.pop(0)
            oldest.handle.exception()  # its failure is the save's to report
            oldest.finish()
        copies: list[TierCopy | ParamCopy] = []
        streamer: TierReader | None = None
        try:
            if offload is not None and isinstance(offload.store, NvmeStore):
                copies.append(copy := TierCopy(offload))
                streamer = TierReader(offload, copy=copy)
            files = saver.mode != "thread"  # a writer process reads files only (ParamCopy.ranges)
            param_copy = ParamCopy(params, files=files) if params is not None else None
            if param_copy is not None:
                copies.append(param_copy)
            result = write(state(streamer, param_copy or False))
        except BaseException:
            _free(streamer, copies)
            raise
        assert isinstance(result, ucp.SaveHandle)
        self.copies = copies
        streamed = _Streamed(result, streamer, copies)
        self.streaming.append(streamed)
        result.add_done_callback(lambda _handle: streamed.finish())
        return result

    def wait_snapshot(self) -> None:
        """Wait for the copy of the last asynchronous save (it may still run in the background:
        ``snapshot="background"``) and for the copies of the swap files it streams; from then on the weights and
        the tiers may change. A failed copy is not raised here: the save reports it."""
        if self.snapshot is not None:
            self.snapshot.wait_snapshot()
            self.snapshot = None
        copies, self.copies = self.copies, []
        for copy in copies:  # the offload tiers may be rewritten once their copies for the save are made
            copy.wait()

    def release_done(self) -> None:
        """Remove the copies of the streamed saves that are over, now: a caller that waited for a save finds its
        copies gone (the save's done-callback, which removes them too, may run later on the writer's thread)."""
        running = []
        for streamed in self.streaming:
            if streamed.handle.done():
                streamed.finish()
            else:
                running.append(streamed)
        self.streaming = running

    def close(self) -> None:
        """Wait for the asynchronous saves still streaming a copy of the swap files (it lies in the tier's swap
        directory, which goes away with the tier), and remove their copies; their failures are theirs to report."""
        self.wait_snapshot()
        streaming, self.streaming = self.streaming, []
        for streamed in streaming:
            streamed.handle.exception()
            streamed.finish()


class _Streamed:
    """An asynchronous save that streams copies of the offload tiers, and what it holds: the reader's buffers and
    the copies on the swap device."""

    def __init__(self, handle: ucp.SaveHandle, reader: TierReader | None, copies: list[TierCopy | ParamCopy]) -> None:
        self.handle = handle
        self._reader = reader
        self._copies = copies
        self._lock = threading.Lock()  # the training thread and the writer's done-callback may both finish it
        self._finished = False

    def finish(self) -> None:
        """The save is done: free what it holds (:func:`_free`); once, from any thread, returning only once it is
        freed."""
        with self._lock:
            if not self._finished:
                _free(self._reader, self._copies)
                self._finished = True


def _free(reader: TierReader | None, copies: list[TierCopy | ParamCopy]) -> None:
    """An asynchronous save that streamed copies of the offload tiers is done (or did not start): free the reader's
    buffers, remove the copies."""
    if reader is not None:
        reader.close()
    for copy in copies:
        copy.close()
