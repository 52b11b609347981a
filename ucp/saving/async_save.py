"""``ucp.async_save``: snapshot the state dict, return at once, write and commit in the background.

::

    handle = ucp.async_save(model.state_dict(), "ckpt/step-100", step=100)
    ...                       # training goes on and may change the tensors right away
    manifest = handle.result()   # or handle.done(), or ``await handle``

What happens on the calling thread (the *stall*), with a copying snapshot
(``snapshot="sync"``; the default ``"auto"`` picks copy-on-write where Linux allows it,
:mod:`ucp.saving.cow.snapshot`, and replaces step 4 by write-protecting the tensors' pages):

1. plan the rank file (cached by layout, as for :func:`ucp.save`);
2. take a staging arena from the saver's pool (blocks while ``max_in_flight``
   snapshots are still being written) — arenas are reused, so a loop saving the
   same model allocates and page-faults its staging memory once;
3. under torch.distributed: rank 0 creates the temporary directory and broadcasts
   its name (one short collective, on the calling thread, before returning);
4. copy every piece into the arena (:func:`ucp.saving.snapshot.snapshot_into`; how and when is the
   snapshot mode's, :mod:`ucp.saving.snapshot_modes`), laid out exactly as the rank file (``copy_``
   into a torch view of the arena, chunk by chunk; with ``pipeline=True`` the
   writer starts writing the chunks already copied). CUDA tensors are copied on a
   side stream into the (pinned) arena; the current stream waits for that copy,
   the host does not.

Then a background writer (:mod:`ucp.saving.background`) writes the file with zero-copy
O_DIRECT writes straight from the arena and commits without collectives: see
:mod:`ucp.saving.background.handshake` for the file-based commit, and :class:`AsyncSaver` for the modes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours (see the end)
import functools
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Generator, Sequence

import torch
from pydantic import ValidationError

from aio import AioConfig
from ucp.dist import Group, resolve_group
from ucp.errors import CommitError, ManifestError, NotACheckpointError, UnsupportedStateError
from ucp.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest, too_large
from ucp.format.tree import Leaf, encode_state
from ucp.saving import snapshot_modes, step_guard
from ucp.saving.background import store_handshake
from ucp.saving.background.handshake import identity, publish_report
from ucp.saving.background.image import Progress
from ucp.saving.background.job import PlanSpec, PostCommit, StoreHandshake, WriteJob, describe, next_job_id
from ucp.saving.background.process_backend import ProcessBackend
from ucp.saving.background.thread_backend import ThreadBackend
from ucp.saving.dtensor import lower_leaves, with_record
from ucp.saving.options import AsyncSaveOptions, Mode, Snapshot
from ucp.saving.plan import PLAN_CACHE, SavePlan, plan_save
from ucp.saving.snapshot import replica_checksums, sourced, streams
from ucp.saving.staging import Arena, StagingPool
from ucp.saving.sync_save import _check_args, save
from ucp.store import commit as _commit
from ucp.store.storage import Storage, as_aio_config, open_storage

log = logging.getLogger(__name__)


class SaveHandle:
    """A save in progress. ``result()`` waits for it and returns the manifest, or raises the save's error.

    Awaitable: ``manifest = await handle`` in asyncio code.
    """

    def __init__(
        self,
        path: str,
        step: int | None,
        future: Future,
        snapshot_seconds: float,
        snapshot: Future | None = None,
        *,
        copied: Future | None = None,
    ) -> None:
        self.path = path
        self.step = step
        self.future = future
        self.snapshot_seconds = snapshot_seconds  # how long async_save kept the caller (the stall)
        self._snapshot = snapshot  # the copy still running (AsyncSaver(snapshot="background")), if any
        self._copied = copied if copied is not None else snapshot  # until the save reads the tensors no more

    def done(self) -> bool:
        return self.future.done()

    def snapshot_done(self) -> bool:
        """Whether the state dict has been copied: from then on its tensors may change."""
        return self._snapshot is None or self._snapshot.done()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Wait until the state dict has been copied (at once unless the snapshot runs in the background).

        With ``AsyncSaver(snapshot="background")`` call it before changing any saved tensor. A
        failed copy is not raised here (the tensors may change: nothing is left to protect) but by
        :meth:`result`.
        """
        if self._snapshot is not None:
            self._snapshot.exception(timeout)

    def wait_copied(self, timeout: float | None = None) -> None:
        """Wait until the save no longer reads the tensors' memory, so their storage may be freed or
        resized (``resize_``, ``untyped_storage().resize_(0)``). Writes need no wait with
        copy-on-write snapshots; with the other modes this is :meth:`wait_snapshot`."""
        if self._copied is not None:
            self._copied.exception(timeout)

    def result(self, timeout: float | None = None) -> Manifest:
        """The committed manifest; raises the save's error, or TimeoutError when not done within ``timeout``."""
        return self.future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.future.exception(timeout)

    def add_done_callback(self, fn: Callable[["SaveHandle"], None]) -> None:
        self.future.add_done_callback(lambda _f: fn(self))

    def __await__(self) -> Generator[Any, None, Manifest]:
        return asyncio.wrap_future(self.future).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SaveHandle({self.path!r}, step={self.step}, {state})"


class AsyncSaver:
    """Owns the staging pool and the background writer of asynchronous saves.

    * ``mode="thread"`` (default): a writer thread in this process. No extra
      process, no shared memory; the checkpoint is lost if this process dies
      before the save completes (as with any in-process save).
    * ``mode="process"``: a writer process started on the first save and kept for
      the saver's life, reading the snapshots from shared memory (``staging_dir``,
      ``/dev/shm``). Once ``save`` has returned, the checkpoint is written and
      committed even if this process is killed; the writer exits when its
      parent is gone and its work is done.

    ``max_in_flight`` bounds the snapshots held at once (staging memory: about
    one rank file per snapshot). When all are in use, ``save`` blocks until the
    oldest save has written its data file; the commit of one save may overlap
    the snapshot of the next. Saves are written and committed in call order.

    ``snapshot="auto"`` (default): ``"cow"`` in thread mode where a write-protect userfaultfd is
    allowed (:func:`ucp.saving.cow.snapshot.cow_unavailable` says why not), else ``"sync"``; :attr:`snapshot` holds
    the choice. ``"sync"``: the state is copied into the staging arena before ``save`` returns.

    ``snapshot="cow"`` (thread mode, host tensors): ``save`` write-protects the tensors' pages and
    returns; a helper process copies them in the background, and a write to a page not copied yet
    (by anything: optimizer step, ``.data``, numpy, the kernel) waits until it is. The checkpoint is
    the state at the call with no promise asked of the caller (:mod:`ucp.saving.cow.snapshot`). Raises
    :class:`ucp.saving.cow.snapshot.CowUnavailable` where the kernel refuses.

    ``snapshot="none"`` (thread mode): nothing is copied; the writer writes straight from the
    tensors, and the caller must not change them until ``handle.wait_snapshot()`` returns (the
    data file is written). No staging memory; the wait is the write, so it pays off when the
    write fits in the time before the tensors change (a training step's forward and backward).

    ``snapshot="background"``: ``save`` returns before copying; the copy runs on a thread while
    the caller goes on, and the caller must not change the saved tensors until
    ``handle.wait_snapshot()`` returns (a training loop: before its optimizer step, so the copy
    overlaps forward and backward). Host tensors only (CUDA copies are already asynchronous).
    The writer follows the copy as with ``pipeline``.

    In both deferred modes a tensor changed in place before it was read (its torch version counter
    moved) fails the save with :class:`ucp.SnapshotChangedError` naming it; nothing is committed.
    With ``hold_optimizer_steps`` (default) every ``torch.optim`` optimizer's ``step()`` waits
    until the deferred snapshots running have read the tensors (:mod:`ucp.saving.step_guard`), so a
    training loop saves the state it asked for even without ``wait_snapshot()``.

    A state dict holding :class:`ucp.StreamedShard` pieces stages none of it: the other pieces are copied
    before ``save`` returns and the writer thread pulls the streamed parts as it writes them
    (:func:`ucp.saving.snapshot_modes.start_streamed`), whatever ``snapshot`` says; in process mode every such
    piece needs a ``source`` (files on disk with known CRCs), which the writer process reads itself
    (:func:`~ucp.saving.snapshot_modes.start_streamed_process`). ``max_in_flight`` bounds such saves too:
    ``save`` waits while that many are still writing their data files.

    ``pipeline=True``: the writer starts writing the chunks already copied while
    the snapshot is still running — durable 5–9% sooner, but the copy then shares
    memory bandwidth and CPU with the writer: on our 2-core test VM the stall grew
    from 0.09 s to 0.16 s per GiB, so it is off by default. ``commit_timeout`` bounds how
    long rank 0 waits for the other ranks' reports and they wait for its commit.

    The options are the fields of :class:`~ucp.saving.options.AsyncSaveOptions` (held as :attr:`options`;
    ``options=`` passes a whole model, keywords go over it, and one left out takes the model's default).
    ``snapshot`` picks one strategy of :mod:`ucp.saving.snapshot_modes` when the saver is made.
    """

    def __init__(
        self,
        max_in_flight: int | None = None,
        mode: Mode | None = None,
        aio_config: AioConfig | dict[str, Any] | None = None,
        *,
        staging_dir: str | None = None,
        commit_timeout: float | None = None,
        pipeline: bool | None = None,
        snapshot: Snapshot | None = None,
        hold_optimizer_steps: bool | None = None,
        options: AsyncSaveOptions | None = None,
    ) -> None:
        """Every keyword left out (or None) takes ``options``' value, else :class:`AsyncSaveOptions`' default."""
        try:
            self.options = AsyncSaveOptions.build(
                options,
                max_in_flight=max_in_flight,
                mode=mode,
                aio_config=aio_config,
                staging_dir=staging_dir,
                commit_timeout=commit_timeout,
                pipeline=pipeline,
                snapshot=snapshot,
                hold_optimizer_steps=hold_optimizer_steps,
            )
        except ValidationError as exc:  # the option's own message, e.g. "mode must be 'thread' or 'process'"
            raise ValueError("; ".join(str(e.get("ctx", {}).get("error", e["msg"])) for e in exc.errors())) from None
        opts = self.options
        self._snapshot_mode = snapshot_modes.choose(opts)
        self.mode: Mode = opts.mode
        self.snapshot: Snapshot = self._snapshot_mode.name  # type: ignore[assignment]  # what "auto" chose
        self._cow = self._snapshot_mode.cow if isinstance(self._snapshot_mode, snapshot_modes.CowSnapshot) else None
        if self._cow is not None:  # a saver dropped without close() still stops its helper process
            weakref.finalize(self, self._cow.close)
        self.hold_optimizer_steps = opts.hold_optimizer_steps
        self.aio_config = opts.aio_config
        self.commit_timeout = opts.commit_timeout
        self.pipeline = opts.pipeline
        self.pool = StagingPool(
            opts.max_in_flight,
            shared=opts.mode == "process",
            directory=opts.staging_dir,
            memfd=self._snapshot_mode.memfd,
        )
        self.pool.on_drop.append(self._snapshot_mode.forget)
        self._backend: ThreadBackend | ProcessBackend = (
            ThreadBackend(self.pool) if opts.mode == "thread" else ProcessBackend(self.pool)
        )
        self._writer = snapshot_modes.Writer(self._backend, self.pool, opts.pipeline, self._stream_for)
        self._pending: set[SaveHandle] = set()
        self._temps: dict[str, int] = {}  # absolute temp dir -> job id, for saves in flight
        self._lock = threading.Lock()
        self._closed = False
        self._streams: dict[torch.device, Any] = {}
        self._streamed: list[Future] = []  # the data files of saves of StreamedShards, being written (in order)
        _LIVE.add(self)

    # -- the public face ------------------------------------------------------------------------
    @property
    def writer_pid(self) -> int | None:
        """The writer process (``mode="process"``), once started."""
        return self._backend.pid if isinstance(self._backend, ProcessBackend) else None

    def start(self, *, wait: bool = True) -> int | None:
        """Start the writer process now rather than on the first save (``mode="process"``); its pid.

        ``wait``: until it is ready for work (it imports torch: seconds).
        """
        if isinstance(self._backend, ProcessBackend):
            return self._backend.start(wait=wait)
        return None

    def in_flight_temps(self) -> set[str]:
        """Absolute paths of the temporary directories of this saver's saves in flight."""
        with self._lock:
            return set(self._temps)

    def save(
        self,
        state_dict: dict[str, Any],
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        process_group: Any = None,
        aio_config: AioConfig | dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        mesh: dict[str, int] | None = None,
        post_commit: PostCommit | None = None,
        check_replicas: bool = False,
        handshake: StoreHandshake | None = None,
    ) -> SaveHandle:
        """Snapshot ``state_dict`` and return; the arguments are those of :func:`ucp.save`.

        With ``check_replicas`` the replicas' checksums are taken here, before returning (one CRC-32C
        pass over the replicated bytes this rank does not write: part of the stall).

        Every rank of ``process_group`` calls it, in the same order. ``post_commit``
        (internal: :class:`ucp.CheckpointManager`) runs on rank 0's writer after the commit.
        ``handshake`` (internal: a node-local tier, :mod:`ucp.tiered`): ``path`` is on each rank's own disk,
        and the ranks meet on that object store to commit (:mod:`ucp.saving.background.store_handshake`).
        """
        if self._closed:
            raise RuntimeError("this AsyncSaver is closed")
        t0 = time.perf_counter()
        group = process_group if isinstance(process_group, Group) else resolve_group(process_group)
        _check_args(step, metadata, mesh, group)
        cfg = as_aio_config(aio_config) or self.aio_config
        storage_opts = storage_options
        if self.mode == "process" and storage_opts is not None:
            try:
                import json

                json.dumps(storage_opts)
            except (TypeError, ValueError):
                raise UnsupportedStateError("storage_options must be plain JSON with mode='process'") from None

        # (a) plan — errors are held until every rank has met in the broadcast
        local_error: BaseException | None = None
        plan: SavePlan | None = None
        leaves: list[Leaf] = []
        tree: Any = None
        arena: Arena | None = None
        replicas: list[_commit.Replica] = []
        try:
            encoded = encode_state(state_dict)
            leaves, records = lower_leaves(encoded.leaves, group)  # DTensors: this rank's regions
            tree, metadata = encoded.tree, with_record(metadata, records)
            plan = plan_save(leaves, group.rank, group.world_size, cache=PLAN_CACHE)
            replicas = (
                [_commit.Replica.of(*r) for r in replica_checksums(leaves, group.rank, group.world_size)]
                if check_replicas
                else []
            )
            streamed = plan.file is not None and streams(plan, leaves)
            if streamed and self.mode != "thread" and not sourced(plan, leaves):
                raise UnsupportedStateError(
                    "a StreamedShard's parts are pulled by the writer from this process: an asynchronous save "
                    "of one without a source (files the writer process reads) needs mode='thread' (this "
                    "saver's mode is 'process')"
                )
            if streamed:  # no arena holds it back: at most max_in_flight such saves write at once
                self._wait_streamed()
            if plan.file is not None and self._snapshot_mode.copies and not streamed:
                arena = self.pool.acquire(plan.file_size)
        except BaseException as exc:
            local_error = exc
            if not group.distributed:
                raise

        try:
            storage, name = open_storage(path, storage_options=storage_opts, aio_config=cfg)
        except BaseException:
            if arena is not None:
                self.pool.release(arena)
            raise
        job_id = next_job_id()
        lock_fd: int | None = None
        try:
            try:
                temp = self._agree_on_temp(storage, name, group, local_error)
                stub = _job_stub(storage, path, name, temp, group, job_id, handshake)
                if local_error is not None:  # this rank failed planning: tell rank 0 so it gives up at once
                    if handshake is not None:
                        store_handshake.publish_error(stub, describe(local_error))
                    else:
                        publish_report(storage, stub, _commit.RankReport(rank=group.rank, error=describe(local_error)))
                    raise local_error
                assert plan is not None
                temp_local = storage.local_path(temp)
                if handshake is not None and temp_local is not None:  # rank 0 made it on its own disk only
                    os.makedirs(temp_local, exist_ok=True)
                temp_abs = temp_local or storage.describe(temp)
                if temp_local is not None and storage.supports_locks:
                    lock_fd = _commit.lock_dir(temp_local)
                job = WriteJob(  # a local path made absolute: the writer may run in another directory
                    id=job_id,
                    path=storage.local_path(name) or os.fspath(path),
                    name=name,
                    temp=temp,
                    temp_identity=identity(storage, temp),
                    storage_options=storage_opts,
                    aio_config=cfg.model_dump() if cfg is not None else None,
                    rank=group.rank,
                    world_size=group.world_size,
                    plan=PlanSpec.of(plan) if plan.file is not None else None,
                    tensors=[(n, d, list(s)) for n, d, s in plan.tensors],
                    tree=tree,
                    step=step,
                    metadata=metadata or {},
                    mesh=mesh,
                    arena_path=arena.path if arena is not None else None,
                    arena_capacity=arena.capacity if arena is not None else 0,
                    commit_timeout=self.commit_timeout,
                    post_commit=post_commit,
                    replicas=replicas,
                    handshake=handshake,
                )
            except BaseException:
                if arena is not None:
                    self.pool.release(arena)
                _commit.close_fd(lock_fd)
                raise
            progress = Progress(plan.file_size if plan.file is not None else 0)
            if streamed and self.mode != "thread":  # the writer process reads the streamed pieces' source files
                future, copying, protected = snapshot_modes.start_streamed_process(
                    self._writer, job, plan, leaves, lock_fd
                )
                with self._lock:
                    self._streamed.append(future)
            elif streamed:  # no arena: the writer thread pulls the streamed parts (snapshot_modes.start_streamed)
                started, written = snapshot_modes.start_streamed(self._writer, job, plan, leaves, lock_fd)
                future, copying, protected = started
                with self._lock:
                    self._streamed.append(written)
            else:
                future, copying, protected = self._snapshot_mode.start(  # owns the arena and lock
                    self._writer, job, plan, leaves, arena, lock_fd, progress
                )
            if copying is not None and not protected and self.hold_optimizer_steps:
                step_guard.hold_steps_until(copying)
        finally:
            storage.close()
        handle = SaveHandle(
            os.fspath(path), step, future, time.perf_counter() - t0, None if protected else copying, copied=copying
        )
        with self._lock:
            self._pending.add(handle)
            self._temps[temp_abs] = job_id
        handle.add_done_callback(functools.partial(_forget, weakref.ref(self), temp_abs))  # weak: a dropped
        # saver is collected (and its helper stopped) even while a writer thread still holds the future
        return handle

    def prepare(self, state_dict: dict[str, Any], *, process_group: Any = None) -> int:
        """Allocate now the staging memory a save of ``state_dict`` will need; returns its bytes.

        The first save otherwise allocates it while the caller waits (measured on the reference
        VM: 0.6-5 s for 2 GiB, as freshly faulted memory is slow there); later saves reuse it.
        Call it where a pause costs nothing, e.g. before the first training step. No collective.
        With copy-on-write snapshots it also starts the helper process, which maps that memory.
        """
        if self._closed:
            raise RuntimeError("this AsyncSaver is closed")
        if not self._snapshot_mode.copies:
            return 0
        group = process_group if isinstance(process_group, Group) else resolve_group(process_group)
        leaves, _ = lower_leaves(encode_state(state_dict).leaves, group)
        plan = plan_save(leaves, group.rank, group.world_size, cache=PLAN_CACHE)
        if plan.file is None or streams(plan, leaves):  # streamed: no arena of the file's size
            return 0
        arena = self.pool.acquire(plan.file_size)
        try:
            self._snapshot_mode.prepare(arena)
        finally:
            self.pool.release(arena)
        return plan.file_size

    def wait(self) -> None:
        """Wait for every save in flight; raises the first failure among them."""
        with self._lock:
            pending = list(self._pending)
        wait_all(pending)

    def close(self, *, wait: bool = True) -> None:
        """Finish (``wait``) the saves in flight, stop the writer and free the staging memory."""
        if self._closed:
            return
        if wait:
            with self._lock:
                pending = list(self._pending)
            for h in pending:
                h.exception()
        self._closed = True
        self._backend.close()
        self.pool.close()
        self._snapshot_mode.close()
        _LIVE.discard(self)

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the steps ------------------------------------------------------------------------------
    def _wait_streamed(self) -> None:
        """Before a save of StreamedShards: wait while ``max_in_flight`` such saves are still writing their data
        files, the oldest first (what a staging arena's pool does for the other saves)."""
        while True:
            with self._lock:
                self._streamed = [f for f in self._streamed if not f.done()]
                if len(self._streamed) < self.options.max_in_flight:
                    return
                oldest = self._streamed[0]
            oldest.exception()  # a failure is the save's to report

    def _agree_on_temp(self, storage: Storage, name: str, group: Group, local_error: BaseException | None) -> str:
        """Rank 0 creates the temporary directory; every rank learns its name (one broadcast)."""
        temp, error = None, None
        if group.rank == 0:
            if local_error is not None:
                error = describe(local_error)
            else:
                try:
                    temp = _commit.make_temp_dir(storage, name)
                except BaseException as exc:
                    if not group.distributed:
                        raise
                    error = describe(exc)
        temp, error = group.broadcast((temp, error))
        if temp is None:
            if local_error is not None:
                raise local_error
            raise CommitError(f"saving {storage.describe(name)} failed on rank 0: {error}", ranks=(0,), reason=error)
        return temp

    def _stream_for(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _forget(self, temp_abs: str, handle: SaveHandle) -> None:
        with self._lock:
            self._pending.discard(handle)
            self._temps.pop(temp_abs, None)


def _forget(saver_ref: "weakref.ref[AsyncSaver]", temp_abs: str, handle: SaveHandle) -> None:
    saver = saver_ref()
    if saver is not None:
        saver._forget(temp_abs, handle)


def wait_all(handles: Sequence[SaveHandle]) -> None:
    """Wait for every handle; then raise the first failure among them, if any."""
    errors = [exc for exc in (h.exception() for h in handles) if exc is not None]
    if errors:
        raise errors[0]


def _job_stub(
    storage: Storage, path: Any, name: str, temp: str, group: Group, job_id: int, handshake: StoreHandshake | None
) -> WriteJob:
    return WriteJob(
        id=job_id,
        path=os.fspath(path),
        name=name,
        temp=temp,
        rank=group.rank,
        world_size=group.world_size,
        handshake=handshake,
    )


# -- the default saver, and the module-level functions -------------------------------------------

_LIVE: "weakref.WeakSet[AsyncSaver]" = weakref.WeakSet()
_DEFAULT: AsyncSaver | None = None
_DEFAULT_LOCK = threading.Lock()


def default_saver() -> AsyncSaver:
    """The saver behind :func:`async_save`: thread mode, one save in flight."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT._closed:
            _DEFAULT = AsyncSaver()
        return _DEFAULT


def async_save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    process_group: Any = None,
    aio_config: AioConfig | dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    mesh: dict[str, int] | None = None,
    check_replicas: bool = False,
) -> SaveHandle:
    """Like :func:`ucp.save`, but returns a :class:`SaveHandle` as soon as the tensors are snapshotted.

    Uses a process-wide :class:`AsyncSaver` (thread mode, one save in flight: a
    second call waits until the first has written its data). Saves still in flight
    when the interpreter exits are waited for.
    """
    return default_saver().save(
        state_dict,
        path,
        step=step,
        metadata=metadata,
        process_group=process_group,
        aio_config=aio_config,
        storage_options=storage_options,
        mesh=mesh,
        check_replicas=check_replicas,
    )


def _drain_at_exit() -> None:
    """Interpreter exit: finish saves in flight before the thread pools they use refuse new work."""
    for saver in list(_LIVE):
        try:
            saver.close(wait=True)
        except Exception as exc:  # pragma: no cover - reported, never raised at exit
            log.error("an asynchronous save failed at exit: %s", exc)


# Runs before concurrent.futures shuts its executors down (registered later, called earlier).
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_drain_at_exit)
else:  # pragma: no cover - other Pythons
    import atexit

    atexit.register(_drain_at_exit)


# -- asyncio -------------------------------------------------------------------------------------


async def asave(state_dict: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> Manifest:
    """``await ucp.asave(...)``: :func:`ucp.save` on the loop's default executor (same arguments).

    The event loop keeps running; the tensors must not change until the await
    completes. To snapshot and carry on at once, ``await ucp.async_save(...)``.
    """
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, functools.partial(save, state_dict, path, **kwargs))


async def aload(
    path: str | os.PathLike[str],
    *,
    into: dict[str, Any] | None = None,
    strict: bool = True,
    map_location: Any = None,
    gds: Any = "auto",
    verify: bool = True,
    process_group: Any = None,
    aio_config: AioConfig | dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """``await ucp.aload(...)``: :func:`ucp.load` without blocking the event loop (same arguments and
    results: the state dict, or with ``strict=False`` a :class:`ucp.loading.loader.LoadReport`).

    On local paths manifest.json is read with aiofiles on the loop; the data files
    are read on the default executor.
    """
    from ucp.loading.loader import LoadReport, load, load_full, load_into

    loop = asyncio.get_running_loop()
    text = os.fspath(path)
    if process_group is not None or storage_options or "://" in text or map_location is not None or gds != "auto":
        return await loop.run_in_executor(
            None,
            functools.partial(
                load,
                path,
                into=into,
                strict=strict,
                map_location=map_location,
                gds=gds,
                verify=verify,
                process_group=process_group,
                aio_config=aio_config,
                storage_options=storage_options,
            ),
        )
    import aiofiles

    storage, name = open_storage(text, aio_config=as_aio_config(aio_config))
    checkpoint_dir = storage.local_path(name)
    assert checkpoint_dir is not None  # a path without "://" and no storage options opens local storage
    manifest_path = os.path.join(checkpoint_dir, MANIFEST_NAME)
    try:
        async with aiofiles.open(manifest_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_MANIFEST_BYTES:  # checked before reading it whole
                raise ManifestError(too_large(manifest_path, size))
            data = await f.read(MAX_MANIFEST_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise NotACheckpointError(
            f"{storage.describe(name)} is not a checkpoint: no {MANIFEST_NAME} (not a checkpoint, "
            "or a save that never committed)"
        ) from None
    manifest = parse_manifest(data, source=manifest_path)

    def run() -> dict[str, Any] | LoadReport:
        with storage:
            if into is None:
                state = load_full(storage, name, manifest, verify=verify)
                return state if strict else LoadReport(state, loaded=[(k,) for k in state], missing=[], unexpected=[])
            report = load_into(storage, name, manifest, into, verify=verify, strict=strict)
            return report.state if strict else report

    return await loop.run_in_executor(None, run)
