"""How an asynchronous save captures the state: one class per ``snapshot=`` mode, chosen once per saver.

Every mode has the same methods: :meth:`SnapshotMode.start` hands one save's job to the writer and
captures the tensors (or arranges for them to be captured), :meth:`~SnapshotMode.prepare` readies a
staging arena ahead of the first save, :meth:`~SnapshotMode.close` stops what the mode runs.
:func:`choose` turns the ``snapshot`` option ("auto" included) into one of them:

* :class:`SyncSnapshot` ("sync") — copy into the staging arena before ``save`` returns;
* :class:`BackgroundSnapshot` ("background") — the copy runs on a thread; the caller waits for it
  (``handle.wait_snapshot()``) before changing the tensors;
* :class:`CowSnapshot` ("cow") — write-protect the tensors' pages; a helper process copies them
  (:mod:`ucp.saving.cow.snapshot`);
* :class:`DirectSnapshot` ("none") — no copy: the writer writes straight from the tensors.

A save of :class:`ucp.StreamedShard` pieces takes none of them: :func:`start_streamed` (thread mode), or
:func:`start_streamed_process` where every such piece has a ``source`` the writer process reads itself.

A mode that cannot apply to one save (CUDA tensors for "background"/"cow", a rank with no file)
falls back to the copying snapshot of :class:`SyncSnapshot` for that save.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

from ucp.errors import CowUnavailable
from ucp.format.tree import Leaf
from ucp.saving import snapshot as _snap
from ucp.saving.background.handshake import abandon
from ucp.saving.background.image import DirectImage, Progress
from ucp.saving.background.job import WriteJob, describe
from ucp.saving.background.process_backend import ProcessBackend
from ucp.saving.background.thread_backend import ThreadBackend
from ucp.saving.cow import snapshot as _cow
from ucp.saving.options import AsyncSaveOptions
from ucp.saving.plan import SavePlan
from ucp.saving.snapshot import ChangeWatch
from ucp.saving.snapshot import snapshot as snapshot_views
from ucp.saving.staging import Arena, StagingPool
from ucp.store.commit import close_fd

log = logging.getLogger(__name__)


@dataclass
class Writer:
    """What a mode needs of its saver: the backend that runs jobs, the staging pool, and how to copy."""

    backend: ThreadBackend | ProcessBackend
    pool: StagingPool
    pipeline: bool
    stream_for: Callable[[Any], Any]  # torch.device -> the side CUDA stream for copies from it


class Started(NamedTuple):
    """One save handed to the writer: the job's future; the copy's, when it runs after ``save`` returns;
    and whether the tensors may change before that copy is done (copy-on-write protects them)."""

    future: Future
    copying: Future | None
    protected: bool


class SnapshotMode:
    """The interface of a snapshot mode; its own behaviour is the copying snapshot (``"sync"``).

    ``name``: the ``snapshot=`` value. ``copies``: saves take a staging arena. ``memfd``: arenas must be
    memfd-backed (another process maps them).
    """

    name: ClassVar[str] = "sync"
    copies: ClassVar[bool] = True
    memfd: ClassVar[bool] = False

    def start(
        self,
        writer: Writer,
        job: WriteJob,
        plan: SavePlan,
        leaves: Sequence[Leaf],
        arena: Arena | None,
        lock_fd: int | None,
        progress: Progress,
    ) -> Started:
        """Start the background job and fill its arena (the writer follows the copy when ``pipeline``).

        Owns ``arena`` and ``lock_fd``: they go to the job, or are given back here on failure.
        """

        future = (
            _submit_or_give_back(writer, job, arena, progress, lock_fd) if writer.pipeline or arena is None else None
        )
        try:
            if arena is not None:
                events = _snap.snapshot_into(plan, leaves, arena, progress, writer.stream_for)
                if events:
                    if isinstance(writer.backend, ProcessBackend):  # another process cannot wait on our CUDA events
                        for ev in events:
                            ev.synchronize()
                        progress.advance(progress.total)
                    else:
                        progress.complete_after(events)
        except BaseException as exc:
            if future is None:
                _give_back(writer, job, arena, lock_fd)
            else:
                _fail_copy(writer, job, progress, exc)
            raise
        if future is None:
            future = _submit_or_give_back(writer, job, arena, progress, lock_fd)
        return Started(future, None, False)

    def prepare(self, arena: Arena) -> None:
        """Ready a staging arena before the first save needs it (nothing to do for most modes)."""

    def forget(self, arena: Arena) -> None:
        """The pool dropped ``arena``."""

    def close(self) -> None:
        """Stop what this mode runs (threads, helper processes); saves in flight are done by now."""


class SyncSnapshot(SnapshotMode):
    """``snapshot="sync"``: the state is copied into the staging arena before ``save`` returns."""


def _give_back(writer: Writer, job: WriteJob, arena: Arena | None, lock_fd: int | None) -> None:
    """``job`` never reached the writer: give back what it owned (its arena, the temp dir's lock) and drop it."""
    if arena is not None:
        writer.pool.release(arena)
    close_fd(lock_fd)
    abandon(job)


def _submit_or_give_back(
    writer: Writer, job: WriteJob, arena: Arena | None, progress: Progress, lock_fd: int | None
) -> Future:
    """Start the writer on ``job`` (it follows ``progress``); if that fails, give back what the job owned."""
    try:
        return writer.backend.submit(job, arena, progress, lock_fd)
    except BaseException:
        _give_back(writer, job, arena, lock_fd)
        raise


def _fail_copy(writer: Writer, job: WriteJob, progress: Progress, exc: BaseException) -> None:
    """The copy for a job the writer already has failed: the job fails, cleans up and gives the arena back."""
    why = f"snapshot failed: {describe(exc)}"
    progress.fail(why)
    if isinstance(writer.backend, ProcessBackend):
        writer.backend.abort(job.id, why)


class BackgroundSnapshot(SnapshotMode):
    """``snapshot="background"``: ``save`` returns before copying; a copier thread copies host tensors while
    the writer follows, and the caller keeps the tensors unchanged until the copy is done."""

    name = "background"

    def __init__(self) -> None:
        self._copier: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(
        self,
        writer: Writer,
        job: WriteJob,
        plan: SavePlan,
        leaves: Sequence[Leaf],
        arena: Arena | None,
        lock_fd: int | None,
        progress: Progress,
    ) -> Started:
        if arena is None or not _snap.on_host(plan, leaves):
            return super().start(writer, job, plan, leaves, arena, lock_fd, progress)
        watch = ChangeWatch(plan, leaves)  # the versions as of this call: the caller's state to save
        future = _submit_or_give_back(writer, job, arena, progress, lock_fd)

        def copy() -> None:
            try:
                _snap.snapshot_into(plan, leaves, arena, progress, writer.stream_for, watch=watch)
            except BaseException as exc:
                watch.release()
                _fail_copy(writer, job, progress, exc)
                raise

        with self._lock:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-snapshot")
            copier = self._copier
        return Started(future, copier.submit(copy), False)

    def close(self) -> None:
        with self._lock:
            copier, self._copier = self._copier, None
        if copier is not None:
            copier.shutdown(wait=True)


class CowSnapshot(SnapshotMode):
    """``snapshot="cow"``: the tensors' pages are write-protected and copied by the helper process
    (:mod:`ucp.saving.cow.snapshot`); the writer starts now and follows it. Where that cannot run for
    one save, the copy is made before ``save`` returns."""

    name = "cow"
    memfd = True

    def __init__(self) -> None:
        self.cow = _cow.CowSnapshots()

    def start(
        self,
        writer: Writer,
        job: WriteJob,
        plan: SavePlan,
        leaves: Sequence[Leaf],
        arena: Arena | None,
        lock_fd: int | None,
        progress: Progress,
    ) -> Started:
        if arena is None or not _snap.on_host(plan, leaves):
            return super().start(writer, job, plan, leaves, arena, lock_fd, progress)
        future = _submit_or_give_back(writer, job, arena, progress, lock_fd)
        try:
            try:
                copying: Future | None = self.cow.start(plan, leaves, arena, progress)  # type: ignore[arg-type]
            except CowUnavailable as exc:
                log.info("copy-on-write snapshot of %s not possible (%s); copying now", job.path, exc)
                copying = None
                if _snap.snapshot_into(plan, leaves, arena, progress, writer.stream_for):
                    raise AssertionError("host tensors gave CUDA copy events") from None
        except BaseException as exc:
            _fail_copy(writer, job, progress, exc)
            raise
        return Started(future, copying, copying is not None)

    def prepare(self, arena: Arena) -> None:
        self.cow.prepare(arena)  # type: ignore[arg-type]

    def forget(self, arena: Arena) -> None:
        self.cow.forget(arena)

    def close(self) -> None:
        self.cow.close()


class DirectSnapshot(SnapshotMode):
    """``snapshot="none"``: no copy; the writer thread writes straight from the tensors (O_DIRECT from their
    memory where the plan put pieces in phase), and the caller keeps them unchanged until the data file
    is written."""

    name = "none"
    copies = False

    def start(
        self,
        writer: Writer,
        job: WriteJob,
        plan: SavePlan,
        leaves: Sequence[Leaf],
        arena: Arena | None,
        lock_fd: int | None,
        progress: Progress,
    ) -> Started:
        if plan.file is None:
            return super().start(writer, job, plan, leaves, arena, lock_fd, progress)
        try:
            watch = ChangeWatch(plan, leaves, aliased_only=True)
            image = DirectImage(plan, snapshot_views(plan, leaves), watch=watch)
            assert isinstance(writer.backend, ThreadBackend)  # choose() allows "none" in thread mode only
            future = writer.backend.submit(job, image, progress, lock_fd)
        except BaseException:
            _give_back(writer, job, None, lock_fd)
            raise
        return Started(future, image.written, False)


def start_streamed(
    writer: Writer, job: WriteJob, plan: SavePlan, leaves: Sequence[Leaf], lock_fd: int | None
) -> tuple[Started, Future]:
    """A save whose plan holds :class:`ucp.StreamedShard` pieces, whatever the mode (thread mode only): no staging
    arena; the other pieces are copied now (:func:`ucp.saving.snapshot.streamed_views`) and the writer thread pulls
    the streamed parts as it writes them, so the state behind them is never all in memory. Their producer keeps
    them consistent until it is asked for them (training.offload: a copy of its swap files). Also returns the
    future of its data file being written (or the job failing)."""
    try:
        image = DirectImage(plan, _snap.streamed_views(plan, leaves))
        assert isinstance(writer.backend, ThreadBackend)  # the saver refuses a StreamedShard in process mode
        future = writer.backend.submit(job, image, Progress(plan.file_size), lock_fd)
    except BaseException:
        _give_back(writer, job, None, lock_fd)
        raise
    return Started(future, None, False), image.written


def start_streamed_process(
    writer: Writer, job: WriteJob, plan: SavePlan, leaves: Sequence[Leaf], lock_fd: int | None
) -> Started:
    """A save of :class:`ucp.StreamedShard` pieces that all have a ``source``, in process mode: the header and the
    other pieces are copied now into a compact arena (their bytes only), and the writer process reads each
    streamed piece from its source files as it writes it (:func:`ucp.saving.background.image.write_streamed`),
    so neither process ever holds the state behind them whole. The job goes to the writer once every shard's
    ``ready`` has resolved (the producer's copy is made), with the sources the shards then give; a failed one
    fails the save (its temporary directory abandoned, as for a job that never reached the writer)."""
    arena: Arena | None = None
    shards = _snap.streamed_sources(plan, leaves)
    places: list[int | None] = []
    try:
        assert plan.file is not None and job.plan is not None
        size = plan.data_start + sum(p.length for p, s in zip(plan.pieces, shards) if s is None)
        arena = writer.pool.acquire(max(size, 1))
        arena.view(plan.data_start, 0)[:] = plan.header
        at = plan.data_start
        for p, shard in zip(plan.pieces, shards):
            places.append(None if shard is not None else at)
            if shard is None:  # copied now: the caller may change it once save returns
                arena.view(p.length, at)[:] = _snap.piece_bytes(p, leaves[p.leaf])
                at += p.length
    except BaseException:
        _give_back(writer, job, arena, lock_fd)
        raise
    outer: Future = Future()
    outer.set_running_or_notify_cancel()
    waits = list({id(s.ready): s.ready for s in shards if s is not None and s.ready is not None}.values())
    state = {"left": len(waits), "failed": False}
    lock = threading.Lock()

    def give_up(exc: BaseException) -> None:
        _give_back(writer, job, arena, lock_fd)
        outer.set_exception(exc)

    def submit() -> None:
        try:
            if writer.pool.closed:  # closed without waiting while the producer's copy was being made
                raise RuntimeError("the asynchronous saver was closed before the streamed state was ready")
            assert job.plan is not None
            pieces = []
            for spec, shard, at in zip(job.plan.pieces, shards, places):
                if shard is None:
                    pieces.append(spec.model_copy(update={"arena": at}))
                else:
                    assert shard.source is not None  # the saver checked (snapshot.sourced)
                    pieces.append(spec.model_copy(update={"source": list(shard.source())}))
            streamed = job.plan.model_copy(update={"pieces": pieces, "streamed": True, "data_start": plan.data_start})
            assert arena is not None and len(pieces) == len(job.plan.pieces)
            full = job.model_copy(update={"plan": streamed, "arena_path": arena.path, "arena_capacity": arena.capacity})
            progress = Progress(plan.file_size)
            progress.advance(progress.total)  # nothing left to copy: the writer starts at once
            inner = writer.backend.submit(full, arena, progress, lock_fd)
        except BaseException as exc:  # noqa: BLE001 - the save's error
            give_up(exc)
            return
        inner.add_done_callback(lambda f: _pass_on(f, outer))

    def one_ready(fut: Future) -> None:
        exc = fut.exception()
        with lock:
            first_failure = exc is not None and not state["failed"]
            state["failed"] = state["failed"] or exc is not None
            state["left"] -= 1
            go = state["left"] == 0 and not state["failed"]
        if first_failure:
            assert exc is not None
            give_up(exc)
        elif go:
            submit()

    if not waits:
        submit()
    for fut in waits:
        fut.add_done_callback(one_ready)
    return Started(outer, None, False)


def _pass_on(src: Future, dst: Future) -> None:
    """Resolve ``dst`` as ``src`` resolved."""
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


MODES: dict[str, type[SnapshotMode]] = {
    "sync": SyncSnapshot,
    "background": BackgroundSnapshot,
    "cow": CowSnapshot,
    "none": DirectSnapshot,
}


def choose(options: AsyncSaveOptions) -> SnapshotMode:
    """The mode for ``options.snapshot``: "auto" is "cow" in thread mode where a write-protect userfaultfd
    is allowed, else "sync". ValueError for a mode that needs ``mode="thread"``; CowUnavailable for
    "cow" where the kernel refuses."""
    snapshot, mode = options.snapshot, options.mode
    if snapshot in ("none", "cow") and mode != "thread":
        raise ValueError(f"snapshot={snapshot!r} works on this process's memory: it needs mode='thread'")
    why_not = _cow.cow_unavailable() if snapshot in ("auto", "cow") and mode == "thread" else "mode='process'"
    if snapshot == "cow" and why_not is not None:
        raise CowUnavailable(f"copy-on-write snapshots are not available here: {why_not}")
    if snapshot == "auto":
        snapshot = "cow" if why_not is None else "sync"
    return MODES[snapshot]()
