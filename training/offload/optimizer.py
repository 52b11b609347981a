"""The offloaded Adam step: sub-groups streamed through a swap tier, pipelined.

:class:`OptimizerOffload` owns this rank's fp32 masters and Adam moments once ZeRO has built them:
they leave memory for the tier (:mod:`training.offload.store`) at start-up, and each step walks the
sub-groups in order::

    read sub-group i+1   ∥   Adam on sub-group i   ∥   write-back of sub-group i-1

Reads run on one I/O thread, write-backs on another, Adam on the calling thread (the kernel's own
threads); the swap pool's slots bound what is in flight. ``pipeline_read`` off: a sub-group is read
only when it is needed; ``pipeline_write`` off: each write-back is waited for before the next
sub-group. Adam is elementwise and sub-groups are cut at multiples of the I/O alignment, so the
update is bit-identical to the in-memory one over the whole partition.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from training.adam import AdamConfig, adam_update

from .config import OffloadConfig
from .errors import OffloadError
from .store import FP32, HostStore, NvmeStore, Record, SubGroup, split
from .swapdir import MIN_ALIGNMENT, SwapDir

log = logging.getLogger(__name__)

Store = HostStore | NvmeStore


class OptimizerOffload:
    """This rank's optimizer state in a swap tier (``config.offload_optimizer.device``: cpu or nvme).

    ``sizes[g]``: elements of ZeRO group ``g``'s partition on this rank; ``rank`` names the swap directory.
    Fill it with :meth:`init_group` (once per group, the initial masters; moments start at zero), then
    call :meth:`step` per optimizer step; :meth:`close` removes the swap directory.
    """

    def __init__(self, config: OffloadConfig, sizes: Sequence[int], *, rank: int) -> None:
        oc = config.offload_optimizer
        if oc.device == "none":
            raise ValueError("OptimizerOffload needs offload_optimizer.device cpu or nvme")
        self.config = config
        self.sizes = list(sizes)
        self.pipeline_read, self.pipeline_write = oc.pipeline_read, oc.pipeline_write
        pin = oc.pin_memory and torch.cuda.is_available()
        self.dir: SwapDir | None = None
        self.store: Store
        if oc.device == "nvme":
            assert oc.nvme_path is not None
            self.dir = SwapDir(oc.nvme_path, rank=rank, what="optimizer", key="offload_optimizer.nvme_path")
            try:
                quantum = self.dir.alignment // FP32
                self.subgroups = split(self.sizes, config.sub_group_size, quantum)
                self.store = NvmeStore(
                    self.subgroups, self.dir, config.aio, slots=oc.slots, budget=config.swap_budget, pin=pin
                )
            except BaseException:
                self.dir.remove()
                raise
        else:
            self.subgroups = split(self.sizes, config.sub_group_size, MIN_ALIGNMENT // FP32)
            self.store = HostStore(self.subgroups, pin=pin)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ucp-offload-read")
        self._ahead: dict[int, Future[Record]] = {}  # the next step's first reads, issued at the end of a step
        self._ahead_taken: list[threading.Event] = []  # set once each of those has its slot
        self._behind: list[tuple[int, Future[None]]] = []  # write-backs left running by the last step
        self._write_mark: float | None = None  # the store's write_seconds when it ended
        self._read_mark = 0.0  # the store's read_seconds when they were issued (they count towards the next step)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ucp-offload-write")
        self._initialised: set[int] = set()
        self._broken: str | None = None  # why a step failed half way (the tier is then partly updated)
        self._stale: set[int] = set()  # groups to rewrite (init_group) before the tier is consistent again
        self.last: dict[str, float] = {}  # the last step's figures (seconds, bytes)

    @property
    def device(self) -> str:
        return self.store.kind

    @property
    def broken(self) -> str | None:
        """Why an earlier step failed half way (the tier is partly updated until a load rewrites it), or None."""
        return self._broken

    def of_group(self, g: int) -> list[SubGroup]:
        return [sg for sg in self.subgroups if sg.group == g]

    # -- start-up --------------------------------------------------------------------------------
    @torch.no_grad()
    def init_group(
        self,
        g: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor | None = None,
        exp_avg_sq: torch.Tensor | None = None,
    ) -> None:
        """Write group ``g``'s fp32 master and Adam moments (whole partitions, any device; moments
        default to zero) into the tier, replacing what it held."""
        flats = []
        for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t is not None and t.numel() != self.sizes[g]:
                raise ValueError(f"group {g}: {name} of {t.numel()} elements, partition of {self.sizes[g]}")
            flats.append(None if t is None else t.detach().reshape(-1))

        def fill(sg: SubGroup, rec: Record) -> None:
            for dst, src in zip((rec.master, rec.exp_avg, rec.exp_avg_sq), flats):
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(src[sg.lo : sg.hi])

        self._walk(self.of_group(g), fill, read=False, record=False)
        self._initialised.add(g)
        self._stale.discard(g)
        if not self._stale:
            self._broken = None  # every group rewritten since the failure (a load): consistent again

    @torch.no_grad()
    def gather_group(
        self, g: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group ``g``'s fp32 master, exp_avg and exp_avg_sq as new whole-partition tensors on ``device``
        (read from the tier, checked; the tier is left as it was)."""
        self._settle_behind()
        if self._broken is not None:
            raise OffloadError(
                f"an earlier optimizer step failed half way ({self._broken}); the offloaded state is partly "
                "updated and cannot be read as a whole: load a checkpoint to go on"
            )
        out = tuple(torch.empty(self.sizes[g], dtype=torch.float32, device=device) for _ in range(3))

        def copy(sg: SubGroup, rec: Record) -> None:
            for dst, src in zip(out, (rec.master, rec.exp_avg, rec.exp_avg_sq)):
                dst[sg.lo : sg.hi].copy_(src)

        self._drop_ahead()
        self._walk(self.of_group(g), copy, read=True, write=False, record=False)
        return out[0], out[1], out[2]

    # Used by training.offload.checkpoint (a save streams the tier's parts, a load rewrites every record).
    def quiesce(self) -> None:
        """Before a checkpoint reads the swap files: no I/O of the tier runs and every slot is free (the
        write-backs the last step left running are waited for, reads ahead dropped); OffloadError if a step
        failed half way (the state is partly updated)."""
        self._settle_behind()
        self._drop_ahead()
        if self._broken is not None:
            raise OffloadError(
                f"an earlier optimizer step failed half way ({self._broken}); the offloaded state is partly "
                "updated and cannot be read as a whole: load a checkpoint to go on"
            )

    @torch.no_grad()
    def rewrite(self, work: Callable[[SubGroup, Record], None]) -> None:
        """Rewrite every sub-group's record (a load): ``work(sg, rec)`` fills the whole record, which goes
        back to the tier behind the next one's ``work``. Afterwards the tier is consistent, even after a
        failed step; if ``work`` or a write-back fails, it is partly rewritten (:attr:`broken`)."""
        try:
            self._walk(self.subgroups, work, read=False, record=False)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            self._stale = {g for g, n in enumerate(self.sizes) if n}
            raise
        self._initialised.update(range(len(self.sizes)))
        self._stale.clear()
        self._broken = None

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        grads: Sequence[torch.Tensor],
        casts: Sequence[torch.Tensor | None],
        *,
        adam: AdamConfig,
        step: int,
        lr: float | None,
        weight_decay: Sequence[float],
        grad_scale: float,
    ) -> None:
        """One Adam update of every sub-group: ``grads[g]`` (this rank's fp32 gradient partition of group
        ``g``) read, ``casts[g]`` (the compute-dtype weights of the partition) written in the same pass."""
        missing = [g for g, n in enumerate(self.sizes) if n and g not in self._initialised]
        if missing:
            raise RuntimeError(f"offloaded optimizer groups {missing} were never initialised (init_group)")
        self._settle_behind()
        if self._broken is not None:
            raise OffloadError(
                f"an earlier optimizer step failed half way ({self._broken}); the offloaded state is partly "
                "updated: load a checkpoint to go on"
            )

        def update(sg: SubGroup, rec: Record) -> None:
            grad = grads[sg.group][sg.lo : sg.hi]
            out = casts[sg.group]
            if out is None:
                raise RuntimeError(f"group {sg.group}: no compute-dtype target for the offloaded update")
            out = out[sg.lo : sg.hi]
            host_out = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
            adam_update(
                rec.master,
                grad if grad.device.type == "cpu" else grad.cpu(),
                rec.exp_avg,
                rec.exp_avg_sq,
                step,
                adam,
                lr=lr,
                weight_decay=weight_decay[sg.group],
                grad_scale=grad_scale,
                out=host_out,
            )
            if host_out is not out:
                out.copy_(host_out)

        ahead, self._ahead = self._ahead, {}
        defer = self.pipeline_write and isinstance(self.store, NvmeStore)
        try:
            self._walk(self.subgroups, update, read=True, ahead=ahead, defer=defer)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            self._stale = {g for g, n in enumerate(self.sizes) if n}
            raise
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Start reading the next step's first sub-groups now, into the free slots, so that those reads run
        behind the next forward and backward instead of opening the next optimizer step (NVMe, ``pipeline_read``).
        Their records hold the state as this step left it; anything else that touches the tier drops them first."""
        self._read_mark = self.store.read_seconds
        if not (isinstance(self.store, NvmeStore) and self.pipeline_read):
            return
        writing = {i for i, _ in self._behind}
        for j, sg in enumerate(self.subgroups[: self.store.slots]):
            if sg.index in writing:  # its write-back is still running: the next step reads it, after that
                break
            taken = threading.Event()
            self._ahead[j] = self._reader.submit(self._take_and_load, sg, taken)
            self._ahead_taken.append(taken)

    def _take_and_load(self, sg: SubGroup, taken: threading.Event) -> Record:
        """A read ahead: wait for a slot (one the last step's write-backs still hold), then read into it."""
        try:
            rec = self.store.acquire(sg, block=True)
        finally:
            taken.set()
        assert rec is not None  # a blocking acquire always returns a slot
        return self._load(sg, rec)

    def _settle_behind(self) -> None:
        """Wait for the write-backs the last step left running; one that failed leaves the tier partly
        updated (:attr:`broken`), which the callers check."""
        behind, self._behind = self._behind, []
        for _, fut in behind:
            exc = _exception(fut)
            if exc is not None and self._broken is None:
                self._broken = f"{type(exc).__name__}: {exc}"
                self._stale = {g for g, n in enumerate(self.sizes) if n}

    def _drop_ahead(self) -> None:
        """Let go of records read ahead for the next step (before the tier is read or written otherwise)."""
        ahead, self._ahead = self._ahead, {}
        self._ahead_taken = []
        _settle(list(ahead.values()))
        for fut in ahead.values():
            if fut.exception() is None:
                self.store.release(fut.result())

    def _load(self, sg: SubGroup, rec: Record) -> Record:
        """Read ``sg`` into ``rec`` (the I/O thread's job); the slot goes back if the read fails."""
        try:
            self.store.read(sg, rec)
        except BaseException:
            self.store.release(rec)
            raise
        return rec

    def _walk(
        self,
        order: Sequence[SubGroup],
        work: Callable[[SubGroup, Record], None],
        *,
        read: bool,
        write: bool = True,
        record: bool = True,
        ahead: dict[int, Future[Record]] | None = None,
        defer: bool = False,
    ) -> None:
        """Run ``work`` on each sub-group of ``order`` in turn with its record in a slot: reads ahead (while
        slots are free) on the read thread, write-backs behind on the write thread (``write``: the record
        goes back to the tier; ``record``: the figures become :attr:`last`; ``ahead``: reads of the first
        sub-groups already issued, by :meth:`_read_ahead`; ``defer``: the write-backs still running at the
        end are left to finish behind the next forward and backward, :attr:`_behind`)."""
        self._settle_behind()
        if ahead:  # the reads ahead take their slots before this walk takes any (else it could starve them)
            for taken in self._ahead_taken:
                taken.wait()
        self._ahead_taken = []
        store = self.store
        t_start = time.perf_counter()
        read_s0 = self._read_mark if ahead else store.read_seconds
        mark = self._write_mark if record else None
        write_s0 = mark if mark is not None else store.write_seconds
        self._write_mark = None
        moved = {"bytes_read": 0.0, "bytes_written": 0.0}  # of this walk's records (also those read ahead for it)
        swapped = isinstance(store, NvmeStore)  # records that really move (the CPU tier's stay where they are)
        waits = {"read_wait": 0.0, "write_wait": 0.0, "compute": 0.0}
        reads: dict[int, Future[Record]] = dict(ahead or {})
        writes: list[tuple[int, Future[None]]] = []
        issued = len(reads)  # sub-groups whose read was issued (in order: the ahead ones are the first)
        if not read:
            self._drop_ahead()

        def save(sg: SubGroup, rec: Record) -> None:
            try:
                store.write(sg, rec)
            finally:
                store.release(rec)

        def issue(j: int, block: bool) -> bool:
            rec = store.acquire(order[j], block)
            if rec is None:
                return False
            if read:
                reads[j] = self._reader.submit(self._load, order[j], rec)
            else:
                done: Future[Record] = Future()
                done.set_result(rec)
                reads[j] = done
            return True

        try:
            for i, sg in enumerate(order):
                t0 = time.perf_counter()
                if issued <= i:
                    issue(i, block=True)
                    issued = i + 1
                if read and self.pipeline_read:
                    while issued < len(order) and issued <= i + store_slots(store) and issue(issued, block=False):
                        issued += 1
                rec = reads.pop(i).result()
                if read and swapped:
                    moved["bytes_read"] += rec.nbytes
                t1 = time.perf_counter()
                waits["read_wait"] += t1 - t0
                try:
                    work(sg, rec)
                except BaseException:
                    store.release(rec)
                    raise
                t2 = time.perf_counter()
                waits["compute"] += t2 - t1
                if not write:
                    store.release(rec)
                    continue
                if swapped:
                    moved["bytes_written"] += rec.nbytes
                fut = self._writer.submit(save, sg, rec)
                writes.append((sg.index, fut))
                if not self.pipeline_write:
                    fut.result()
                    waits["write_wait"] += time.perf_counter() - t2
                while writes and writes[0][1].done():  # a failed write-back stops the step here
                    writes.pop(0)[1].result()
            if defer:
                self._behind, writes = writes, []
            t3 = time.perf_counter()
            for _, w in writes:
                w.result()
            waits["write_wait"] += time.perf_counter() - t3
        finally:
            _settle([*reads.values(), *(w for _, w in writes)])  # no buffer reused while I/O may touch it
            for pending in reads.values():
                if pending.done() and pending.exception() is None:
                    store.release(pending.result())
        if not record:
            return
        if defer:  # the time of write-backs still running counts towards the next step
            self._write_mark = store.write_seconds
        self.last = {
            "seconds": time.perf_counter() - t_start,
            **moved,
            "io_read": store.read_seconds - read_s0,  # seconds the read thread was busy (hidden or waited for)
            "io_write": store.write_seconds - write_s0,
            **waits,
        }

    def describe(self) -> dict[str, Any]:
        """The tier's shape, for logs and reports."""
        out: dict[str, Any] = {"device": self.device, "subgroups": len(self.subgroups)}
        if isinstance(self.store, NvmeStore):
            out |= {
                "dir": str(self.store.dir.path),
                "alignment": self.store.alignment,
                "slots": self.store.slots,
                "slot_bytes": self.store.slot_bytes,
                "pool_bytes": self.store.pool_bytes,
                "budget": self.store.budget,
                "read_ahead": len(self._ahead),  # the next step's records already being read
                "write_behind": sum(not f.done() for _, f in self._behind),  # the last step's, still running
            }
        else:
            out["resident_bytes"] = self.store.resident_bytes
        return out

    def close(self) -> None:
        """Stop the I/O threads, close the tier and remove the swap directory (idempotent)."""
        self._settle_behind()
        self._drop_ahead()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.store.close()
        if self.dir is not None:
            self.dir.remove()


def store_slots(store: Store) -> int:
    """How far ahead reads may run: the pool's slots (a HostStore lends every record at once)."""
    return store.slots if isinstance(store, NvmeStore) else len(store.subgroups)


def _exception(fut: Future) -> BaseException | None:
    """Wait for ``fut``; its exception, or None."""
    try:
        return fut.exception()
    except BaseException as exc:  # noqa: BLE001 - cancelled
        return exc


def _settle(futures: Sequence[Future]) -> None:
    for fut in futures:
        try:
            fut.exception()
        except BaseException:  # noqa: BLE001 - cancelled: nothing in flight
            pass


__all__ = ["OffloadError", "OptimizerOffload"]
