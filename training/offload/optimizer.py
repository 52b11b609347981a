"""The offloaded Adam step: sub-groups streamed through a swap tier, pipelined, overlapped with backward.

:class:`OptimizerOffload` owns this rank's fp32 masters and Adam moments once ZeRO has built them:
they leave memory for the tier (:mod:`training.offload.store`) at start-up, and each step is a *pass*
over the sub-groups::

    read sub-group i+1   ∥   Adam on sub-group i   ∥   write-back of sub-group i-1

Reads run on one I/O thread, write-backs on another, Adam on the calling thread (the kernel's own
threads); the swap pool's slots bound what is in flight. A pass's reads are issued in the order its
sub-groups will be needed, at most a pool's worth ahead of the updates, and the first of them as soon
as the previous step ends, so they run behind the next forward. When the caller *arms* the pass
(:meth:`begin_step`, before the step's last backward) and hands over sub-groups as backward finishes
their gradients (:meth:`ready`: the gradients leave for the tier during backward), each is updated
and written back as soon as its record is in, still inside backward; :meth:`step` then only finishes
what is left. The order of a pass's reads is the order the last armed pass's sub-groups became ready.
Write-backs still running at the end of a step finish behind the next forward (``pipeline_write``).

``pipeline_read`` off: a sub-group is read only when it is needed; ``pipeline_write`` off: each
write-back is waited for before the next sub-group. Adam is elementwise and sub-groups are cut at
multiples of the I/O alignment, so the update is bit-identical to the in-memory one over the whole
partition, whatever order the sub-groups are updated in.
"""

from __future__ import annotations

import logging
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
Update = Callable[[SubGroup, Record], None]


class _Pass:
    """One step's walk over the sub-groups (see the module docstring)."""

    def __init__(self, order: Sequence[SubGroup]) -> None:
        self.order = list(order)  # the order reads are issued in
        self.reads: dict[int, Future[Record | None]] = {}  # position in ``order`` -> its read (NVMe)
        self.issued = 0  # positions whose read was issued, or that need none (always a prefix of ``order``)
        self.inflight = 0  # swapped records read (or being read) and not yet updated
        self.done: set[int] = set()  # positions updated (their record handed to a write-back)
        self.ready: set[int] = set()  # sub-group indices whose gradients are complete
        self.ready_order: list[int] = []  # the same, in the order they became ready (an armed pass)
        self.update: Update | None = None  # the armed update (begin_step), else set by step
        self.step: int | None = None  # the Adam step it was armed for
        self.updated: Callable[[SubGroup], None] | None = None  # told of each sub-group updated (armed)
        self.writes: list[tuple[int, Future[None]]] = []  # (sub-group index, write-back)
        self.cancelled = False
        self.moved = {"bytes_read": 0.0, "bytes_written": 0.0}
        self.waits = {"read_wait": 0.0, "write_wait": 0.0, "compute": 0.0, "early_compute": 0.0}
        self.early = 0  # sub-groups updated before step() (during backward)

    @property
    def armed(self) -> bool:
        return self.step is not None


class OptimizerOffload:
    """This rank's optimizer state in a swap tier (``config.offload_optimizer.device``: cpu or nvme).

    ``sizes[g]``: elements of ZeRO group ``g``'s partition on this rank; ``rank`` names the swap directory.
    Fill it with :meth:`init_group` (once per group, the initial masters; moments start at zero), then
    call :meth:`step` per optimizer step (optionally armed before the last backward with :meth:`begin_step`
    and fed with :meth:`ready`); :meth:`close` removes the swap directory.
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
                    self.subgroups,
                    self.dir,
                    config.aio,
                    slots=oc.slots,
                    budget=config.swap_budget,
                    pin=pin,
                    ratio=oc.ratio,
                    keep_resident=config.keep_resident,
                )
            except BaseException:
                self.dir.remove()
                raise
        else:
            self.subgroups = split(self.sizes, config.sub_group_size, MIN_ALIGNMENT // FP32)
            self.store = HostStore(self.subgroups, pin=pin)
        self._swapped = isinstance(self.store, NvmeStore)  # records that really move (the CPU tier's stay put)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ucp-offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ucp-offload-write")
        self._pass: _Pass | None = None  # the next (or current) step's pass, its reads perhaps running
        self._order = list(self.subgroups)  # the order the next pass reads in (learnt from armed passes)
        self._learnt = False  # whether _order is one an armed pass recorded (else index order or a suggestion)
        self._behind: dict[int, Future[None]] = {}  # write-backs the last step left running, by sub-group
        self._read_mark = 0.0  # the store's read_seconds when the pending pass began reading
        self._write_mark = 0.0  # its write_seconds when the last step ended
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

    @property
    def can_update_early(self) -> bool:
        """Whether :meth:`begin_step` / :meth:`ready` may update sub-groups during backward: the CPU tier, or the
        NVMe tier with ``pipeline_read`` (unpipelined, every read would stall backward)."""
        return not self._swapped or self.pipeline_read

    @property
    def order(self) -> list[int]:
        """The sub-groups (by index) in the order the next step reads them: the order backward handed them over
        in the last armed step (:meth:`ready`), index order before one."""
        return [sg.index for sg in self._order]

    def suggest_order(self, indices: Sequence[int]) -> None:
        """The order the caller expects to hand sub-groups over in (:meth:`ready`): the next pass reads in it, until
        an armed pass has recorded the real one. A pass already under way keeps its order."""
        if not self._learnt and sorted(indices) == list(range(len(self.subgroups))):
            self._order = [self.subgroups[i] for i in indices]

    def of_group(self, g: int) -> list[SubGroup]:
        return [sg for sg in self.subgroups if sg.group == g]

    # -- start-up and checkpoints ----------------------------------------------------------------
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

        self._walk(self.of_group(g), fill, read=False)
        self._initialised.add(g)
        self._stale.discard(g)
        if not self._stale:
            self._broken = None  # every group rewritten since the failure (a load): consistent again

    @torch.no_grad()
    def init_group_from(self, g: int, source: Callable[[int, int, torch.Tensor], None]) -> None:
        """Like :meth:`init_group` with zero moments, the master made a sub-group at a time by ``source(lo, hi,
        out)`` (fill ``out`` with elements ``[lo, hi)`` of group ``g``'s partition): no whole fp32 copy."""

        def fill(sg: SubGroup, rec: Record) -> None:
            source(sg.lo, sg.hi, rec.master)
            rec.exp_avg.zero_()
            rec.exp_avg_sq.zero_()

        self._walk(self.of_group(g), fill, read=False)
        self._initialised.add(g)
        self._stale.discard(g)
        if not self._stale:
            self._broken = None

    @torch.no_grad()
    def gather_group(
        self, g: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group ``g``'s fp32 master, exp_avg and exp_avg_sq as new whole-partition tensors on ``device``
        (read from the tier, checked; the tier is left as it was)."""
        self.quiesce()
        out = tuple(torch.empty(self.sizes[g], dtype=torch.float32, device=device) for _ in range(3))

        def copy(sg: SubGroup, rec: Record) -> None:
            for dst, src in zip(out, (rec.master, rec.exp_avg, rec.exp_avg_sq)):
                dst[sg.lo : sg.hi].copy_(src)

        self._walk(self.of_group(g), copy, read=True, write=False)
        return out[0], out[1], out[2]

    # Used by training.offload.checkpoint (a save streams the tier's parts, a load rewrites every record).
    def quiesce(self) -> None:
        """Before a checkpoint reads the swap files: no I/O of the tier runs and every slot is free
        (:meth:`_quiesce`); OffloadError if a step failed half way (the state is partly updated)."""
        self._quiesce()
        if self._broken is not None:
            raise OffloadError(
                f"an earlier optimizer step failed half way ({self._broken}); the offloaded state is partly "
                "updated and cannot be read as a whole: load a checkpoint to go on"
            )

    @torch.no_grad()
    def rewrite(self, work: Update) -> None:
        """Rewrite every sub-group's record (a load): ``work(sg, rec)`` fills the whole record, which goes
        back to the tier behind the next one's ``work``. Afterwards the tier is consistent, even after a
        failed step; if ``work`` or a write-back fails, it is partly rewritten (:attr:`broken`)."""
        try:
            self._walk(self.subgroups, work, read=False)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            self._stale = {g for g, n in enumerate(self.sizes) if n}
            raise
        self._initialised.update(range(len(self.sizes)))
        self._stale.clear()
        self._broken = None

    def _quiesce(self) -> None:
        """Drop the reads started for the next step and wait for the write-backs the last step left running:
        afterwards the swap files hold the state and no I/O of the tier runs. A failed write-back leaves
        :attr:`broken` set (the callers check)."""
        self._drop_ahead()
        self._settle_behind()

    def wait_io(self) -> None:
        """Wait, leaving everything in place, for the write-backs the last step left running and the reads it
        started for the next step (benchmarks: no I/O of this tier runs while another method is timed)."""
        p = self._pass
        _settle([*self._behind.values(), *(p.reads.values() if p is not None else ())])

    def _walk(
        self, order: Sequence[SubGroup], work: Update, *, read: bool, write: bool = True, record: bool = False
    ) -> None:
        """Run ``work`` on each sub-group of ``order`` in turn with its record in a slot, outside a step
        (start-up, checkpoints): reads ahead on the read thread while slots are free, write-backs behind
        (``record``: accepted for callers; figures are only recorded by a step)."""
        self._quiesce()
        store = self.store

        def save(sg: SubGroup, rec: Record) -> None:
            try:
                store.write(sg, rec)
            finally:
                store.release(rec)

        reads: dict[int, Future[Record]] = {}
        writes: list[Future[None]] = []
        issued = 0

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
                if issued <= i:
                    issue(i, block=True)
                    issued = i + 1
                if read:
                    while issued < len(order) and issued <= i + store_slots(store) and issue(issued, block=False):
                        issued += 1
                rec = reads.pop(i).result()
                try:
                    work(sg, rec)
                except BaseException:
                    store.release(rec)
                    raise
                if not write:
                    store.release(rec)
                    continue
                writes.append(self._writer.submit(save, sg, rec))
                while writes and writes[0].done():  # a failed write-back stops the walk here
                    writes.pop(0).result()
            for w in writes:
                w.result()
        finally:
            _settle([*reads.values(), *writes])  # no buffer reused while I/O may touch it
            for pending in reads.values():
                if pending.done() and pending.exception() is None:
                    store.release(pending.result())
        self._write_mark = store.write_seconds

    # -- the step --------------------------------------------------------------------------------
    def _updater(
        self,
        grads: Sequence[torch.Tensor],
        casts: Sequence[torch.Tensor | None],
        *,
        adam: AdamConfig,
        step: int,
        lr: float | None,
        weight_decay: Sequence[float],
        grad_scale: float,
        gradient: Callable[[SubGroup], torch.Tensor] | None = None,
    ) -> Update:
        """The Adam update of one sub-group's record: ``grads[g]`` (or ``gradient(sg)``) read, ``casts[g]`` written
        in the same pass."""

        def update(sg: SubGroup, rec: Record) -> None:
            grad = grads[sg.group][sg.lo : sg.hi] if gradient is None else gradient(sg)
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

        return update

    def _check_ready_to_step(self) -> None:
        missing = [g for g, n in enumerate(self.sizes) if n and g not in self._initialised]
        if missing:
            raise RuntimeError(f"offloaded optimizer groups {missing} were never initialised (init_group)")
        if self._broken is not None:
            raise OffloadError(
                f"an earlier optimizer step failed half way ({self._broken}); the offloaded state is partly "
                "updated: load a checkpoint to go on"
            )

    @torch.no_grad()
    def begin_step(
        self,
        grads: Sequence[torch.Tensor],
        casts: Sequence[torch.Tensor | None],
        *,
        adam: AdamConfig,
        step: int,
        lr: float | None,
        weight_decay: Sequence[float],
        grad_scale: float,
        updated: Callable[[SubGroup], None] | None = None,
        gradient: Callable[[SubGroup], torch.Tensor] | None = None,
    ) -> None:
        """Arm the next step's pass before its last backward: the arguments are :meth:`step`'s. From now on,
        each sub-group handed to :meth:`ready` (its gradient in ``grads`` final) is updated as soon as its
        record is in, and ``casts`` receive its weights then; :meth:`step` finishes the rest, :meth:`abort`
        disarms. ``updated(sg)`` is called once each sub-group's update is done (its gradient is spent).
        ``gradient(sg)``, if given, supplies a sub-group's fp32 gradient (``sg.numel`` elements, read before
        the next call) in place of ``grads[sg.group][sg.lo:sg.hi]``."""
        if not self.can_update_early:
            raise RuntimeError("begin_step needs the CPU tier or pipeline_read")
        self._check_ready_to_step()
        self._check_behind()
        p = self._pass or self._new_pass()
        if p.armed:
            raise RuntimeError("begin_step twice without a step")
        p.update = self._updater(
            grads,
            casts,
            adam=adam,
            step=step,
            lr=lr,
            weight_decay=weight_decay,
            grad_scale=grad_scale,
            gradient=gradient,
        )
        p.step = step
        p.updated = updated

    @torch.no_grad()
    def ready(self, indices: Sequence[int]) -> None:
        """Sub-groups (by index) whose gradients backward has just completed: update each now if its record is
        in, else as soon as it is (on a later call, or in :meth:`step`); never waits for I/O."""
        p = self._pass
        if p is None or not p.armed:
            raise RuntimeError("ready() without begin_step()")
        for i in indices:
            if i not in p.ready:
                p.ready.add(i)
                p.ready_order.append(i)
        try:
            self._check_behind()
            self._pump(p, block=False)
        except BaseException as exc:
            self._fail(exc)
            raise

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
        ``g``) read, ``casts[g]`` (the compute-dtype weights of the partition) written in the same pass.
        An armed pass (:meth:`begin_step`) keeps its own arguments and only finishes the sub-groups left."""
        self._check_ready_to_step()
        t_start = time.perf_counter()
        self._settle_behind()
        self._check_ready_to_step()
        p = self._pass or self._new_pass()
        if p.armed:
            if p.step != step:
                raise RuntimeError(f"the pass was armed for Adam step {p.step}, not {step}")
        else:
            p.update = self._updater(
                grads, casts, adam=adam, step=step, lr=lr, weight_decay=weight_decay, grad_scale=grad_scale
            )
        p.ready.update(sg.index for sg in p.order)
        defer = self.pipeline_write and self._swapped
        try:
            self._pump(p, block=True)
            t3 = time.perf_counter()
            if not defer:
                for _, w in p.writes:
                    w.result()
            else:
                for _, w in p.writes:  # a write-back that already failed stops the step here
                    if w.done():
                        w.result()
            p.waits["write_wait"] += time.perf_counter() - t3
        except BaseException as exc:
            self._fail(exc)
            raise
        store = self.store
        self._pass = None
        self._behind = dict(p.writes)
        if p.armed and len(p.ready_order) == len(self.subgroups):  # the order backward hands them over
            self._order = [self.subgroups[i] for i in p.ready_order]
            self._learnt = True
        self.last = {
            "seconds": time.perf_counter() - t_start,
            **p.moved,
            "io_read": store.read_seconds - self._read_mark,  # seconds the read thread was busy (hidden or waited for)
            "io_write": store.write_seconds - self._write_mark,
            **p.waits,
            "early": float(p.early),  # sub-groups updated during backward, before step()
        }
        self._write_mark = store.write_seconds  # write-backs still running count towards the next step
        if self._swapped and self.pipeline_read:
            self._new_pass()  # the next step's first reads start now, behind its forward

    def abort(self) -> None:
        """A step that will not finish (its backward failed): disarm the pass. If it already updated sub-groups,
        the tier is partly updated (:attr:`broken`) until a load rewrites it; if not, its reads stay for the next."""
        p = self._pass
        if p is None or not p.armed:
            return
        if p.done:
            self._fail(RuntimeError(f"the step was abandoned after updating {len(p.done)} sub-groups during backward"))
            self._quiesce()
            return
        p.update, p.step = None, None
        p.ready.clear()
        p.ready_order.clear()

    def _fail(self, exc: BaseException) -> None:
        if self._broken is None:
            self._broken = f"{type(exc).__name__}: {exc}"
            self._stale = {g for g, n in enumerate(self.sizes) if n}

    def _new_pass(self) -> _Pass:
        """The pass of the next step; its first reads (a pool's worth, pipelined NVMe) are issued now."""
        p = _Pass(self._order)
        self._pass = p
        self._read_mark = self.store.read_seconds
        if self._swapped and self.pipeline_read:
            self._issue(p)
        return p

    def _issue(self, p: _Pass, upto: int | None = None) -> None:
        """Issue the reads of ``p``'s positions, in order, on the read thread: up to position ``upto`` (exclusive),
        or (None) while fewer than a pool's worth of swapped records are read and not yet updated. A resident
        sub-group needs no read."""
        stop = len(p.order) if upto is None else min(upto, len(p.order))
        while p.issued < stop:
            sg = p.order[p.issued]
            if not self.store.is_resident(sg):
                if upto is None and p.inflight >= store_slots(self.store):
                    return
                p.reads[p.issued] = self._reader.submit(self._fetch, p, sg, self._behind.get(sg.index))
                p.inflight += 1
            p.issued += 1

    def _fetch(self, p: _Pass, sg: SubGroup, after: Future[None] | None) -> Record | None:
        """A read of ``p`` (the read thread's job): after ``sg``'s last write-back (``after``), wait for a slot, then
        read into it; None once the pass is dropped."""
        if after is not None:
            exc = _exception(after)
            if exc is not None:
                raise exc  # the state this read would see was never written whole
        if p.cancelled:
            return None
        rec = self.store.acquire(sg, block=True)
        assert rec is not None  # a blocking acquire always returns a slot
        if p.cancelled:
            self.store.release(rec)
            return None
        return self._load(sg, rec)

    def _record(self, p: _Pass, k: int, block: bool) -> Record | None:
        """The record of ``p``'s position ``k`` once read (None: not yet, and ``block`` is False)."""
        sg = p.order[k]
        if self.store.is_resident(sg):
            return self.store.acquire(sg)
        if k >= p.issued:
            if not block:
                return None
            self._issue(p, k + 1)  # unpipelined: read only when needed
        fut = p.reads[k]
        if not block and not fut.done():
            return None
        t0 = time.perf_counter()
        rec = fut.result()
        p.waits["read_wait"] += time.perf_counter() - t0
        del p.reads[k]
        assert rec is not None  # only a dropped pass reads nothing
        return rec

    def _pump(self, p: _Pass, *, block: bool) -> None:
        """Update every ready sub-group of ``p`` whose record is in (``block``: wait for the reads, in order)."""
        assert p.update is not None
        store = self.store
        for k, sg in enumerate(p.order):
            if k in p.done or sg.index not in p.ready:
                continue
            rec = self._record(p, k, block)
            if rec is None:
                continue
            t1 = time.perf_counter()
            try:
                p.update(sg, rec)
            except BaseException:
                store.release(rec)
                raise
            p.done.add(k)
            if p.updated is not None:
                p.updated(sg)
            t2 = time.perf_counter()
            p.waits["compute" if block else "early_compute"] += t2 - t1
            p.early += not block
            if self.store.is_resident(sg):
                continue
            p.inflight -= 1
            p.moved["bytes_read"] += rec.nbytes
            p.moved["bytes_written"] += rec.nbytes
            fut = self._writer.submit(self._save, sg, rec)
            p.writes.append((sg.index, fut))
            if not self.pipeline_write:
                fut.result()
                p.waits["write_wait"] += time.perf_counter() - t2
            if self.pipeline_read:
                self._issue(p)  # the slot just handed over reads the next

    def _save(self, sg: SubGroup, rec: Record) -> None:
        try:
            self.store.write(sg, rec)
        finally:
            self.store.release(rec)

    def _check_behind(self) -> None:
        """Raise the error of a write-back the last step left running that has failed already (never waits)."""
        for fut in self._behind.values():
            if fut.done() and fut.exception() is not None:
                exc = fut.exception()
                assert exc is not None
                self._fail(exc)
                raise exc

    def _settle_behind(self) -> None:
        """Wait for the write-backs the last step left running; one that failed leaves the tier partly
        updated (:attr:`broken`), which the callers check."""
        behind, self._behind = self._behind, {}
        for fut in behind.values():
            exc = _exception(fut)
            if exc is not None:
                self._fail(exc)

    def _drop_ahead(self) -> None:
        """Drop the pending pass: its reads are cancelled or waited for and their slots given back; write-backs it
        started are waited for. A pass that already updated sub-groups leaves the tier partly updated."""
        p, self._pass = self._pass, None
        if p is None:
            return
        p.cancelled = True
        if p.done:
            self._fail(RuntimeError(f"a step was dropped after updating {len(p.done)} sub-groups"))
        for fut in p.reads.values():
            fut.cancel()
        for k in sorted(p.reads):  # in order: the read thread runs them in order, each may wait for a slot
            fut = p.reads[k]
            if _exception(fut) is None and not fut.cancelled():
                rec = fut.result()
                if rec is not None:
                    self.store.release(rec)
        for _, w in p.writes:
            exc = _exception(w)
            if exc is not None:
                self._fail(exc)

    def _load(self, sg: SubGroup, rec: Record) -> Record:
        """Read ``sg`` into ``rec`` (the I/O thread's job); the slot goes back if the read fails."""
        try:
            self.store.read(sg, rec)
        except BaseException:
            self.store.release(rec)
            raise
        return rec

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
                "read_ahead": self._read_ahead(),  # the next step's records being read (or read) already
                "write_behind": sum(not f.done() for f in self._behind.values()),  # the last step's, still running
                "resident": len(self.store.resident),  # sub-groups kept in host memory, never swapped
                "resident_bytes": self.store.resident_bytes,
                "swapped_bytes": sum(self.store.record_bytes(sg) for sg in self.store.swapped),  # moved each way a step
                "host_bytes": self.store.pool_bytes + self.store.resident_bytes,
            }
        else:
            out["resident_bytes"] = out["host_bytes"] = self.store.resident_bytes
        out["pinned_bytes"] = out["host_bytes"] if self.store.pinned else 0
        return out

    def _read_ahead(self) -> int:
        p = self._pass
        return 0 if p is None else len(p.reads)

    def close(self) -> None:
        """Stop the I/O threads, close the tier and remove the swap directory (idempotent)."""
        self._quiesce()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.store.close()
        if self.dir is not None:
            self.dir.remove()


def store_slots(store: Store) -> int:
    """How far ahead reads may run: the pool's slots (a HostStore lends every record at once)."""
    return max(1, store.slots) if isinstance(store, NvmeStore) else len(store.subgroups)


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
