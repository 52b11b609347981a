"""The background half of an asynchronous save: write a snapshot's rank file, then commit without collectives.

A :class:`WriteJob` (JSON: the plan, names, the state tree — never tensor bytes)
describes one rank's part of one save; :func:`execute` carries it out from a
staging arena (:mod:`ucp.saving.staging`) that the training thread fills, following
:class:`Progress` (so with ``pipeline=True`` writing starts before the snapshot
is complete).

It runs in one of two places:

* :class:`ThreadBackend` — a writer thread in the training process (``mode="thread"``);
* :class:`ProcessBackend` — a writer process started once per saver
  (``python -m ucp.saving.background``), fed over a pipe with JSON lines and reading the
  arenas through shared memory (``mode="process"``). It keeps going when the
  training process dies: every job whose snapshot was complete is written and
  committed, then the process exits.

**File-based commit.** Background writers must not run collectives (gloo is not
safe next to the training loop's own), so ranks meet in the temporary directory:

1. each rank writes its data file (durable), then its :class:`~ucp.store.commit.RankReport`
   as ``<temp>/.report-rank-NNNNN.json`` (written aside, renamed in);
2. rank 0 waits (``commit_timeout``) for all reports — failing at once if one
   reports an error — deletes them, builds and commits the manifest
   (:func:`ucp.store.commit.build_manifest`, :func:`ucp.store.commit.commit`), so the final
   directory holds only ``manifest.json`` and the data files;
3. the other ranks poll until rank 0 has moved *their* temporary directory to the
   final path (same device and inode; on object stores: the final manifest holds
   their pieces) — or until rank 0 gave up: it then writes its reason as
   ``<temp>/.abandoned.json``, waits up to ``ACK_TIMEOUT`` for each waiting rank's
   ``.abandoned-seen-rank-NNNNN`` (so every rank's error says why), and deletes the
   directory; a directory that vanished without a commit also means rank 0 gave up.

Temporary directories of saves in flight are held with a shared ``flock``, so a
cleaner (:class:`ucp.CheckpointManager`) can tell them from leftovers of killed saves. On local
storage each rank's writer also holds an exclusive lock on ``<temp>/.alive-rank-NNNNN`` for the
whole save: a rank that dies releases it, and the ranks waiting in steps 2 and 3 fail at once
instead of waiting out ``commit_timeout`` (rank 0 removes these files before the commit).
"""

from __future__ import annotations

import fcntl
import glob
import importlib
import itertools
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict

from aio import AioConfig
from reshard.box import Box, FlatRange
from ucp import errors as _errors
from ucp.errors import CheckpointError, CommitError
from ucp.format.manifest import Manifest, Piece, now_utc, parse_manifest
from ucp.saving.plan import SavePlan
from ucp.saving.staging import Arena, SharedArena, StagingPool
from ucp.store import commit as _commit
from ucp.store.commit import close_fd, lock_dir
from ucp.store.reader import read_manifest
from ucp.store.storage import Storage, open_storage
from ucp.store.writer import CrcChain, write_rank_file

if TYPE_CHECKING:
    from ucp.saving.snapshot import ChangeWatch

log = logging.getLogger(__name__)

REPORT_RE = re.compile(r"^\.report-rank-(\d{5})\.json$")
POLL_MIN, POLL_MAX = 0.005, 0.1  # seconds between looks at the temporary directory
PROGRESS_STEP = 8 << 20  # process mode: tell the writer about snapshot progress at most every this many bytes


@dataclass
class DirectImage:
    """In-process writes only: the rank file is written straight from the caller's tensors (byte views in
    plan order), with no staging copy. ``written`` resolves once the data file is durable (or the job
    failed): until then the caller must not change the tensors."""

    plan: SavePlan
    views: list[memoryview]
    watch: "ChangeWatch | None" = None  # checked once the file is written, before the commit

    written: Future = field(default_factory=Future)

    def check_unchanged(self) -> None:
        """Raise SnapshotChangedError if the caller changed a tensor before the data file was written."""
        if self.watch is not None:
            self.watch.check_all()

    def finished(self) -> None:
        self.views = []
        if self.watch is not None:
            self.watch.release()
        if not self.written.done():
            self.written.set_result(None)


def alive_name(rank: int) -> str:
    return f".alive-rank-{rank:05d}"


def hold_alive(storage: Storage, job: "WriteJob") -> int | None:
    """Take this rank's liveness lock for the save (local storage): an exclusive flock on
    ``<temp>/.alive-rank-NNNNN``, held until the save ends. The kernel drops it when the process
    dies, so the other ranks can tell a dead writer from a slow one instead of waiting out
    ``commit_timeout``. Returns the fd to close, None where there is no such lock."""
    final = storage.local_path(f"{job.temp}/{alive_name(job.rank)}")
    if final is None or not storage.supports_locks:
        return None
    aside = f"{final}.{os.getpid()}"
    try:
        fd = os.open(aside, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(aside, final)  # appears already locked: a probe never sees it unlocked while we live
    except OSError:  # no flock here (e.g. ENOLCK): no fast death detection, and no stray file left behind
        os.close(fd)
        try:
            os.unlink(aside)
        except OSError:
            pass
        return None
    return fd


def rank_dead(storage: Storage, job: "WriteJob", rank: int) -> bool:
    """Whether ``rank`` took its liveness lock for this save and no longer holds it (it died)."""
    alive = storage.local_path(f"{job.temp}/{alive_name(rank)}")
    if alive is None or not storage.supports_locks:
        return False
    try:  # read-write: NFS emulates flock with fcntl locks, and an exclusive one needs a writable fd
        fd = os.open(alive, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False  # not started yet (or done): keep waiting, bounded by commit_timeout
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held (alive), or locks do not work here: only a lock we got proves a death
    finally:
        os.close(fd)
    return True


def drop_alive_files(storage: Storage, job: "WriteJob") -> None:
    """Rank 0, before the commit: remove the liveness files so the checkpoint holds only its data."""
    if not storage.supports_locks:  # no liveness files were made (see hold_alive)
        return
    for rank in range(job.world_size):
        try:
            storage.remove_file(f"{job.temp}/{alive_name(rank)}")
        except OSError:
            pass


def report_name(rank: int) -> str:
    return f".report-rank-{rank:05d}.json"


ABANDONED_NAME = ".abandoned.json"  # rank 0's reason for giving up a save, for the other ranks to read
ACK_TIMEOUT = 2.0  # seconds rank 0 waits for the waiting ranks to read that reason before removing the directory


def ack_name(rank: int) -> str:
    return f".abandoned-seen-rank-{rank:05d}"


# -- the job -------------------------------------------------------------------------------------


class PieceSpec(BaseModel):
    """A planned piece, as JSON."""

    model_config = ConfigDict(extra="forbid")
    name: str
    offset: int
    length: int
    box: tuple[list[int], list[int]] | None = None  # (offsets, shape)
    flat: tuple[int, int] | None = None  # (start, stop)
    entry: str | None = None  # header entry name when not ``name``

    def region(self) -> Box | FlatRange:
        if self.box is not None:
            return Box.of(*self.box)
        assert self.flat is not None
        return FlatRange(*self.flat)


class PlanSpec(BaseModel):
    """What the writer needs of a :class:`~ucp.saving.plan.SavePlan` (the header is already in the arena image)."""

    model_config = ConfigDict(extra="forbid")
    file: str
    file_size: int
    pieces: list[PieceSpec]

    @classmethod
    def of(cls, plan: SavePlan) -> "PlanSpec":
        assert plan.file is not None
        pieces = []
        for p in plan.pieces:
            r = p.region
            if isinstance(r, Box):
                pieces.append(
                    PieceSpec(
                        name=p.name,
                        offset=p.offset,
                        length=p.length,
                        entry=p.entry,
                        box=(list(r.offsets), list(r.shape)),
                    )
                )
            else:
                pieces.append(
                    PieceSpec(name=p.name, offset=p.offset, length=p.length, entry=p.entry, flat=(r.start, r.stop))
                )
        return cls(file=plan.file, file_size=plan.file_size, pieces=pieces)


class PostCommit(BaseModel):
    """A function (``"ucp.module:function"``) rank 0's writer calls with ``kwargs`` after the commit."""

    model_config = ConfigDict(extra="forbid")
    call: str
    kwargs: dict[str, Any] = {}


class WriteJob(BaseModel):
    """One rank's part of one asynchronous save."""

    model_config = ConfigDict(extra="forbid")
    id: int
    path: str  # the checkpoint path as the user gave it
    name: str  # its last component (the final directory, relative to the storage root)
    temp: str  # the temporary directory, relative to the storage root
    temp_identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the temporary directory, local storage only
    storage_options: dict[str, Any] | None = None
    aio_config: dict[str, Any] | None = None
    rank: int = 0
    world_size: int = 1
    plan: PlanSpec | None = None  # None: this rank writes no file
    tensors: list[tuple[str, str, list[int]]] = []
    tree: Any = None
    step: int | None = None
    metadata: dict[str, Any] = {}
    mesh: dict[str, int] | None = None
    arena_path: str | None = None  # process mode: the shared-memory file holding the image
    arena_capacity: int = 0
    commit_timeout: float = 1800.0
    post_commit: PostCommit | None = None
    replicas: list[_commit.Replica] = []  # check_replicas: checksums taken when the save was asked for

    def open_storage(self) -> tuple[Storage, str]:
        cfg = AioConfig.model_validate(self.aio_config) if self.aio_config is not None else None
        return open_storage(self.path, storage_options=self.storage_options, aio_config=cfg)


class SnapshotAborted(CheckpointError):
    """The snapshot feeding a background write failed or its process died before it was complete."""


class Progress:
    """How many bytes of an arena image are filled: the snapshot advances it, the writer waits on it.

    CUDA pieces are copied asynchronously; :meth:`complete_after` leaves their
    events with the progress, and the first writer that needs those bytes waits
    for the events (so the training thread never does).
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.ready = 0
        self.error: str | None = None
        self._events: Sequence[Any] | None = None
        self._cond = threading.Condition()
        self.listeners: list[Callable[[int], None]] = []

    @property
    def complete(self) -> bool:
        return self.ready >= self.total and self._events is None

    def advance(self, upto: int) -> None:
        with self._cond:
            if upto <= self.ready or self.error is not None:  # a failed snapshot never becomes complete
                return
            self.ready = min(upto, self.total)
            self._cond.notify_all()
        for fn in self.listeners:
            fn(self.ready)

    def complete_after(self, events: Sequence[Any]) -> None:
        """The rest of the image is ready once ``events`` (torch.cuda.Event) have completed."""
        with self._cond:
            self._events = list(events)
            self._cond.notify_all()

    def fail(self, message: str) -> None:
        with self._cond:
            if self.error is None and not self.complete:
                self.error = message
            self._cond.notify_all()

    def wait(self, need: int, timeout: float | None = None) -> int:
        """Block until at least ``need`` bytes are ready; returns how many are. Raises SnapshotAborted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.ready < need or self.error is not None:
                if self.error is not None:
                    raise SnapshotAborted(self.error)
                if self._events is not None:
                    events, self._events = self._events, None
                    self._cond.release()
                    try:
                        for ev in events:
                            ev.synchronize()
                    finally:
                        self._cond.acquire()
                    self.ready = self.total
                    self._cond.notify_all()
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"snapshot did not reach byte {need} within {timeout}s")
                self._cond.wait(left)
            return self.ready


# -- writing one image ---------------------------------------------------------------------------


def write_image(
    storage: Storage, rel_path: str, plan: PlanSpec, arena: Arena, progress: Progress
) -> list[tuple[str, Piece]]:
    """Stream the arena's file image to ``rel_path`` as the snapshot fills it; CRC-32C of every piece on the way.

    Like :func:`ucp.store.writer.write_rank_file`, but the bytes are already laid out as
    the file, so whole blocks go to disk straight from the (aligned) arena with no
    copy. Writes are issued in segments of ``queue_depth`` blocks. On error the
    partial file is deleted.
    """
    cfg = storage.config
    block = cfg.block_size
    segment = block * max(1, cfg.queue_depth)
    size = plan.file_size
    with CrcChain() as crcs:
        writer = storage.open_writer(rel_path, size)
        try:
            pos, first = 0, 0  # pieces are in file order: those before ``first`` are done
            pieces = plan.pieces
            while pos < size:
                ready = progress.wait(min(size, pos + block))  # at least a whole block (or the tail)
                end = min(ready, pos + segment)
                if end < size:
                    end = pos + (end - pos) // block * block  # whole blocks: zero-copy, nothing staged
                view = arena.view(end - pos, pos)
                parts = []
                for i in range(first, len(pieces)):
                    p = pieces[i]
                    if p.offset >= end:
                        break
                    lo, hi = max(p.offset, pos), min(p.offset + p.length, end)
                    if lo < hi:
                        parts.append((i, view[lo - pos : hi - pos]))
                    if p.offset + p.length <= end:
                        first = i + 1
                crcs.feed_many(parts)  # one hand-off per segment, however many pieces it holds
                writer.write(view, borrow=True)  # the arena stays unchanged until close(): no wait per segment
                pos = end
            written = writer.close()
            values = crcs.results()
        except BaseException:
            writer.abort()
            raise
    if written != size:
        raise RuntimeError(f"{rel_path}: wrote {written} bytes, plan says {size}")
    return [
        (
            p.name,
            Piece.from_region(
                p.region(), file=plan.file, offset=p.offset, length=p.length, crc32c=values.get(i, 0), entry=p.entry
            ),
        )
        for i, p in enumerate(plan.pieces)
    ]


# -- locks on temporary directories --------------------------------------------------------------


def identity(storage: Storage, rel: str) -> tuple[int, int] | None:
    """(device, inode) of a local directory: it follows the directory through the commit's rename."""
    path = storage.local_path(rel)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


# -- executing a job -----------------------------------------------------------------------------


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def execute(
    job: WriteJob,
    storage: Storage,
    arena: Arena | None,
    progress: Progress,
    release_arena: Callable[[], None] = lambda: None,
) -> Manifest:
    """Write this rank's file from the arena, then take part in the file-based commit; the committed manifest."""
    alive = hold_alive(storage, job)
    try:
        return _execute(job, storage, arena, progress, release_arena)
    finally:
        close_fd(alive)


def _execute(
    job: WriteJob, storage: Storage, arena: Arena | None, progress: Progress, release_arena: Callable[[], None]
) -> Manifest:
    error: BaseException | None = None
    report: _commit.RankReport | None = None
    try:
        records: list[tuple[str, Piece]] = []
        if job.plan is not None:
            assert arena is not None
            try:
                rel = f"{job.temp}/{job.plan.file}"
                if isinstance(arena, DirectImage):
                    records = write_rank_file(storage, rel, arena.plan, arena.views)
                    arena.check_unchanged()
                else:
                    records = write_image(storage, rel, job.plan, arena, progress)
            finally:
                release_arena()
        report = _commit.RankReport(
            rank=job.rank,
            file=job.plan.file if job.plan else None,
            file_size=job.plan.file_size if job.plan else 0,
            tensors=job.tensors,
            pieces=records,
            state=job.tree,
            replicas=job.replicas,
        )
    except BaseException as exc:  # noqa: BLE001 - reported, then re-raised
        error = exc
        if job.plan is None:
            release_arena()

    if job.rank != 0:
        if error is not None:
            try:  # tell rank 0, so that it gives up now rather than at its timeout
                publish_report(storage, job, _commit.RankReport(rank=job.rank, error=describe(error)))
            except (CommitError, OSError) as exc:
                log.debug("could not report rank %d's error: %s", job.rank, exc)
            raise error
        assert report is not None
        publish_report(storage, job, report)
        return wait_for_commit(storage, job, report)

    if error is not None:
        give_up(storage, job, error)
        raise error
    assert report is not None
    try:
        reports = [report] + collect_reports(storage, job)
        manifest = _commit.build_manifest(
            reports, world_size=job.world_size, step=job.step, metadata=job.metadata, mesh=job.mesh, created=now_utc()
        )
        drop_alive_files(storage, job)
        _commit.commit(storage, job.temp, job.name, manifest)
    except BaseException as exc:
        give_up(storage, job, exc)
        raise
    if job.post_commit is not None:
        run_post_commit(job.post_commit, storage.describe(job.name))
    return manifest


def run_post_commit(spec: PostCommit, where: str) -> None:
    module, _, func = spec.call.partition(":")
    if not module.startswith("ucp.") or not func:
        raise CommitError(f"refusing post-commit call {spec.call!r} (only ucp functions)")
    try:
        getattr(importlib.import_module(module), func)(**spec.kwargs)
    except Exception as exc:
        raise CommitError(
            f"{where} is committed, but the step after the commit ({spec.call}) failed: {describe(exc)}"
        ) from exc


def abandon(job: WriteJob, why: str = "snapshot failed") -> None:
    """A job that never reached (or never ran on) a writer: remove its temp dir (rank 0), or report the
    failure into it (other ranks) so rank 0 gives up at once."""
    storage, _ = job.open_storage()
    with storage:
        if job.rank == 0:
            _commit.abort(storage, job.temp)
        else:
            try:
                publish_report(storage, job, _commit.RankReport(rank=job.rank, error=why))
            except CommitError:
                pass


def give_up(storage: Storage, job: WriteJob, error: BaseException) -> None:
    """Rank 0 abandons a save: leave its reason in the temporary directory for the ranks waiting on the
    commit, give them up to ACK_TIMEOUT to read it (ranks that died or failed are not waited for),
    then remove the directory. Best effort: never masks ``error``."""
    if job.world_size > 1:
        try:
            final = f"{job.temp}/{ABANDONED_NAME}"
            storage.write_small(final + ".part", json.dumps({"error": describe(error)}).encode())
            storage.rename(final + ".part", final)
            deadline = time.monotonic() + ACK_TIMEOUT
            while time.monotonic() < deadline:
                names = set(storage.listdir(job.temp))
                if all(ack_name(r) in names or rank_dead(storage, job, r) for r in range(1, job.world_size)):
                    break
                time.sleep(POLL_MAX / 2)
        except Exception as exc:  # noqa: BLE001 - the directory may be gone, the storage failing
            log.debug("could not tell the other ranks why %s was abandoned: %s", storage.describe(job.temp), exc)
    _commit.abort(storage, job.temp)


def abandoned_because(storage: Storage, job: WriteJob) -> str | None:
    """Ranks > 0: rank 0's reason for abandoning this save, once it left one (acknowledged here)."""
    try:
        reason = json.loads(storage.read_small(f"{job.temp}/{ABANDONED_NAME}"))["error"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        storage.write_small(f"{job.temp}/{ack_name(job.rank)}", b"")
    except OSError:
        pass
    return str(reason)


def publish_report(storage: Storage, job: WriteJob, report: _commit.RankReport) -> None:
    """Put this rank's report in the temporary directory, atomically (written aside, then renamed)."""
    final = f"{job.temp}/{report_name(job.rank)}"
    try:
        storage.write_small(final + ".part", report.model_dump_json().encode())
        storage.rename(final + ".part", final)
    except (FileNotFoundError, NotADirectoryError):
        raise CommitError(
            f"{storage.describe(job.temp)} vanished before rank {job.rank} could report: "
            "rank 0 abandoned the save (its error says why)"
        ) from None


def collect_reports(storage: Storage, job: WriteJob) -> list[_commit.RankReport]:
    """Rank 0: every other rank's report, waiting up to ``commit_timeout``; CommitError on an error report."""
    want = set(range(1, job.world_size))
    got: dict[int, _commit.RankReport] = {}
    deadline = time.monotonic() + job.commit_timeout
    delay = POLL_MIN
    while True:
        for entry in storage.listdir(job.temp):
            m = REPORT_RE.match(entry)
            if m is None or int(m.group(1)) in got or int(m.group(1)) not in want:
                continue
            r = _commit.RankReport.model_validate_json(storage.read_small(f"{job.temp}/{entry}"))
            if r.error is not None:
                raise CommitError(f"save of {storage.describe(job.name)} failed on rank {r.rank}: {r.error}")
            got[r.rank] = r
        if len(got) == len(want):
            break
        dead = [r for r in sorted(want - set(got)) if rank_dead(storage, job, r)]
        if dead and not any(
            REPORT_RE.match(e) and int(REPORT_RE.match(e).group(1)) in dead  # type: ignore[union-attr]
            for e in storage.listdir(job.temp)
        ):
            raise CommitError(
                f"save of {storage.describe(job.name)}: rank(s) {dead[:8]} died while writing "
                "(their writer's lock is gone and they never reported)"
            )
        if time.monotonic() > deadline:
            missing = sorted(want - set(got))
            raise CommitError(
                f"save of {storage.describe(job.name)}: rank(s) {missing[:8]} did not report within "
                f"{job.commit_timeout:.0f}s (crashed, or much slower?)"
            )
        time.sleep(delay)
        delay = min(delay * 2, POLL_MAX)
    for rank in sorted(got):
        storage.remove_file(f"{job.temp}/{report_name(rank)}")
    return [got[r] for r in sorted(got)]


def wait_for_commit(storage: Storage, job: WriteJob, report: _commit.RankReport) -> Manifest:
    """Ranks > 0: wait until rank 0 has committed this save (see the module docstring), then read its manifest."""
    deadline = time.monotonic() + job.commit_timeout
    delay = POLL_MIN
    while True:
        if job.temp_identity is not None and identity(storage, job.name) == job.temp_identity:
            return _committed(storage, job)
        reason = abandoned_because(storage, job)
        if reason is not None:
            raise CommitError(
                f"rank 0 did not commit {storage.describe(job.name)}: {reason}; rank {job.rank}'s data was written"
            )
        if not storage.exists(job.temp):
            # The temporary directory is gone: rank 0 committed it (renamed) or gave up (deleted).
            if job.temp_identity is not None:
                if identity(storage, job.name) == job.temp_identity:
                    return _committed(storage, job)
            elif _manifest_holds(storage, job, report):
                return _committed(storage, job)
            raise CommitError(
                f"rank 0 did not commit {storage.describe(job.name)} (its error says why); "
                f"rank {job.rank}'s data was written"
            )
        if rank_dead(storage, job, 0):
            if job.temp_identity is not None and identity(storage, job.name) == job.temp_identity:
                return _committed(storage, job)
            raise CommitError(
                f"rank 0 died before committing {storage.describe(job.name)}; rank {job.rank}'s data was written"
            )
        if time.monotonic() > deadline:
            raise CommitError(f"rank 0 did not commit {storage.describe(job.name)} within {job.commit_timeout:.0f}s")
        time.sleep(delay)
        delay = min(delay * 2, POLL_MAX)


def _committed(storage: Storage, job: WriteJob) -> Manifest:
    deadline = time.monotonic() + 5.0
    while True:  # the rename is atomic, so the manifest is there; retry only for slow shared file systems
        try:
            return read_manifest(storage, job.name)
        except CheckpointError:
            if time.monotonic() > deadline:
                raise
            time.sleep(POLL_MAX)


def _manifest_holds(storage: Storage, job: WriteJob, report: _commit.RankReport) -> bool:
    """Object stores: does the checkpoint now at the final path contain exactly this rank's pieces?"""
    try:
        m = read_manifest(storage, job.name)
    except CheckpointError:
        return False
    if m.step != job.step:
        return False
    if report.file is None:
        return all(name in m.tensors for name, _, _ in job.tensors)
    mine = {(name, p.offset, p.crc32c) for name, p in report.pieces}
    theirs = {(name, p.offset, p.crc32c) for name, t in m.tensors.items() for p in t.pieces if p.file == report.file}
    return mine == theirs and report.file in m.files and m.files[report.file].size == report.file_size


# -- in-process writer thread --------------------------------------------------------------------


class StorageCache:
    """Keeps one local storage (and its aio engine) per directory and config across saves."""

    def __init__(self) -> None:
        self._local: dict[tuple[str, str], Storage] = {}

    def open(self, job: WriteJob) -> tuple[Storage, bool]:
        """(storage, owned): owned storages are the caller's to close."""
        storage, _ = job.open_storage()
        if not storage.local:  # only local storage holds an aio engine worth keeping
            return storage, True
        key = (storage.root, json.dumps(job.aio_config, sort_keys=True))
        cached = self._local.setdefault(key, storage)
        return cached, False

    def close(self) -> None:
        for s in self._local.values():
            s.close()
        self._local.clear()


class ThreadBackend:
    """Runs jobs one after another on a writer thread of this process."""

    def __init__(self, pool: StagingPool) -> None:
        self._pool = pool
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._storages = StorageCache()
        self._lock = threading.Lock()

    def submit(
        self, job: WriteJob, arena: Arena | DirectImage | None, progress: Progress, lock_fd: int | None
    ) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ucp-async-writer", daemon=True)
                self._thread.start()
        self._queue.put((job, arena, progress, lock_fd, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            job, arena, progress, lock_fd, fut = item
            if not fut.set_running_or_notify_cancel():  # cancelled while queued: give everything back
                if isinstance(arena, DirectImage):
                    arena.finished()
                elif arena is not None:
                    self._pool.release(arena)
                close_fd(lock_fd)
                abandon(job, "the save was cancelled")
                continue
            released = threading.Event()

            def release(arena: Arena | DirectImage | None = arena, released: threading.Event = released) -> None:
                if arena is not None and not released.is_set():
                    released.set()
                    if isinstance(arena, DirectImage):
                        arena.finished()  # the caller's tensors are free again
                    else:
                        self._pool.release(arena)

            try:
                storage, owned = self._storages.open(job)
                try:
                    manifest = execute(job, storage, arena, progress, release)
                finally:
                    if owned:
                        storage.close()
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                release()
                close_fd(lock_fd)
                fut.set_exception(exc)
            else:
                close_fd(lock_fd)
                fut.set_result(manifest)

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        self._storages.close()


# -- writer process: the training side -----------------------------------------------------------


class ProcessBackend:
    """Feeds jobs to a writer process (started on first use, again if it died) and collects the outcomes.

    Protocol, one JSON object per line. To the writer (its stdin): ``job`` (a
    WriteJob), ``progress`` (bytes of the job's arena filled), ``abort`` (the
    snapshot failed), ``drop_arena`` (unmap a staging file), ``close``. From the
    writer (its stdout): ``ready``, ``arena_free`` (the job's data file is written:
    the arena may be reused), ``done`` (with the manifest) or ``error`` (type,
    message, errno, filename). End of stdin without ``close`` means the trainer died.
    """

    def __init__(self, pool: StagingPool) -> None:
        self._pool = pool
        self._proc: subprocess.Popen[bytes] | None = None
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._pending: dict[int, tuple[Future, Arena | None, int | None, WriteJob]] = {}
        self._ready = threading.Event()
        pool.on_drop.append(self._drop_arena)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, *, wait: bool = True, timeout: float = 120.0) -> int:
        """Start the writer process if needed (and wait until it is ready for work); its pid."""
        proc = self._ensure()
        deadline = time.monotonic() + timeout
        while wait and not self._ready.wait(0.05):
            code = proc.poll()
            if code is not None:
                raise CommitError(f"the writer process (pid {proc.pid}) exited with code {code} while starting")
            if time.monotonic() > deadline:
                raise CommitError(f"the writer process (pid {proc.pid}) did not start within {timeout:.0f}s")
        return proc.pid

    def _ensure(self) -> subprocess.Popen[bytes]:
        with self._state_lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
            here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ucp.saving.background",
                    "--parent",
                    str(os.getpid()),
                    "--staging-prefix",
                    self._pool.prefix,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                start_new_session=True,  # a Ctrl-C or hang-up of the training job does not kill a save in flight
            )
            self._proc = proc
            self._ready = ready = threading.Event()
            threading.Thread(target=self._read, args=(proc, ready), name="ucp-writer-results", daemon=True).start()
            return proc

    def _send(self, proc: subprocess.Popen[bytes], msg: dict[str, Any]) -> None:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self._send_lock:
            assert proc.stdin is not None
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise CommitError(f"the writer process (pid {proc.pid}) is gone: {exc}") from None

    def submit(self, job: WriteJob, arena: Arena | None, progress: Progress, lock_fd: int | None) -> Future:
        proc = self._ensure()
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self._state_lock:
            self._pending[job.id] = (fut, arena, lock_fd, job)
        try:
            self._send(proc, {"op": "job", "job": job.model_dump(mode="json")})
        except BaseException:
            with self._state_lock:
                mine = self._pending.pop(job.id, None) is not None
            if not mine:  # the writer died meanwhile and _read already failed the job and gave everything back
                return fut
            raise
        sent = [0]

        def forward(ready: int) -> None:
            # Small messages, at most one per PROGRESS_STEP bytes copied. A dead writer shows up in the result.
            if ready >= sent[0] + PROGRESS_STEP or (ready == progress.total and ready > sent[0]):
                sent[0] = ready
                try:
                    self._send(proc, {"op": "progress", "id": job.id, "ready": ready})
                except CommitError:
                    pass

        progress.listeners.append(forward)
        if progress.ready:
            forward(progress.ready)
        return fut

    def abort(self, job_id: int, message: str) -> None:
        """The snapshot failed: tell the writer to drop the job."""
        proc = self._proc
        if proc is not None:
            try:
                self._send(proc, {"op": "abort", "id": job_id, "error": message})
            except CommitError:
                pass

    def _read(self, proc: subprocess.Popen[bytes], ready: threading.Event) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                log.warning("writer process said: %r", line[:200])
                continue
            op, job_id = msg.get("op"), msg.get("id")
            if op == "ready":
                ready.set()
                continue
            with self._state_lock:
                entry = self._pending.get(job_id)
            if entry is None:
                continue
            fut, arena, lock_fd, _job = entry
            if op == "arena_free":
                self._release(job_id)
                continue
            with self._state_lock:
                self._pending.pop(job_id, None)
            self._release_arena(arena)
            close_fd(lock_fd)
            if op == "done":
                fut.set_result(parse_manifest(msg["manifest"], source="writer process"))
            else:
                fut.set_exception(rebuild_error(msg))
        code = proc.wait()
        with self._state_lock:
            pending, self._pending = self._pending, {}
            if self._proc is proc:
                self._proc = None
        for fut, arena, lock_fd, job in pending.values():
            self._release_arena(arena)
            close_fd(lock_fd)
            why = f"the writer process (pid {proc.pid}) exited with code {code} before finishing this save"
            try:
                abandon(job, why)  # its temporary directory (rank 0), or a report that makes rank 0 give up
            except Exception as exc:  # noqa: BLE001 - best effort: the save's error below says what happened
                log.debug("could not clean up after the writer process: %s", exc)
            fut.set_exception(CommitError(why))

    def _release(self, job_id: int) -> None:
        with self._state_lock:
            entry = self._pending.get(job_id)
            if entry is None or entry[1] is None:
                return
            self._pending[job_id] = (entry[0], None, entry[2], entry[3])
        self._release_arena(entry[1])

    def _release_arena(self, arena: Arena | None) -> None:
        if arena is not None:
            self._pool.release(arena)

    def _drop_arena(self, arena: Arena) -> None:
        proc = self._proc
        if proc is not None and arena.path is not None:
            try:
                self._send(proc, {"op": "drop_arena", "path": arena.path})
            except CommitError:
                pass

    def close(self) -> None:
        with self._state_lock:
            proc = self._proc
        if proc is None:
            return
        try:
            self._send(proc, {"op": "close"})
            assert proc.stdin is not None
            proc.stdin.close()
        except (CommitError, OSError):
            pass
        proc.wait()


def rebuild_error(msg: dict[str, Any]) -> BaseException:
    """The writer process's error, as the same kind of exception where we can."""
    kind, text = msg.get("type", "Error"), msg.get("message", "")
    if msg.get("errno") is not None:
        return OSError(msg["errno"], msg.get("strerror") or text, msg.get("filename"))
    cls = getattr(_errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        return cls(text)
    return CommitError(f"{kind}: {text}")


def error_message(job_id: int, exc: BaseException) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": "error", "id": job_id, "type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OSError) and exc.errno is not None:
        msg.update(errno=exc.errno, strerror=exc.strerror, filename=exc.filename)
    return msg


# -- writer process: the process itself ----------------------------------------------------------


class _WriterProcess:
    """``python -m ucp.saving.background --parent PID``: runs jobs from stdin until told to close or orphaned."""

    def __init__(self, parent: int, out: Any, staging_prefix: str | None = None) -> None:
        self.parent = parent
        self.staging_prefix = staging_prefix
        self.out = out
        self.out_lock = threading.Lock()
        self.jobs: dict[int, tuple[WriteJob, Progress]] = {}
        self.queue: queue.Queue[Any] = queue.Queue()
        self.arenas: dict[str, SharedArena] = {}
        self.lock = threading.Lock()
        self.orphaned = False
        self.storages = StorageCache()

    def send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg, separators=(",", ":")) + "\n"
        with self.out_lock:
            try:
                self.out.write(data)
                self.out.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # the training process is gone; the checkpoint on disk is what counts

    def dispatch(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "job":
            job = WriteJob.model_validate(msg["job"])
            progress = Progress(job.plan.file_size if job.plan else 0)
            lock_fd = None
            if job.temp_identity is not None:  # hold the temporary directory as "in flight" ourselves
                storage, _ = job.open_storage()
                lock_fd = lock_dir(storage.path(job.temp))  # type: ignore[attr-defined]
            with self.lock:
                self.jobs[job.id] = (job, progress)
            self.queue.put((job, progress, lock_fd))
        elif op == "progress":
            entry = self.jobs.get(msg["id"])
            if entry is not None:
                entry[1].advance(int(msg["ready"]))
        elif op == "abort":
            entry = self.jobs.get(msg["id"])
            if entry is not None:
                entry[1].fail(msg.get("error") or "the snapshot failed")
        elif op == "drop_arena":
            arena = self.arenas.pop(msg["path"], None)
            if arena is not None:
                arena.close(unlink=False)

    def stop(self, *, orphaned: bool) -> None:
        log.info("stopping (%s)", "trainer gone" if orphaned else "closed")
        with self.lock:
            if orphaned and not self.orphaned:
                self.orphaned = True
                for _job, progress in self.jobs.values():
                    progress.fail("the training process exited before its snapshot was complete")
        self.queue.put(None)

    def watch_parent(self) -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != self.parent:
                self.stop(orphaned=True)
                return

    def arena(self, job: WriteJob) -> SharedArena | None:
        if job.arena_path is None:
            return None
        arena = self.arenas.get(job.arena_path)
        if arena is None or arena.capacity < job.arena_capacity:
            arena = SharedArena.attach(job.arena_path, job.arena_capacity)
            self.arenas[job.arena_path] = arena
        return arena

    def run_jobs(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                break
            job, progress, lock_fd = item
            try:
                storage, owned = self.storages.open(job)
                try:
                    arena = self.arena(job)
                    manifest = execute(
                        job, storage, arena, progress, lambda job=job: self.send({"op": "arena_free", "id": job.id})
                    )
                finally:
                    if owned:
                        storage.close()
            except BaseException as exc:  # noqa: BLE001 - reported to the trainer
                log.info("job %s failed: %s", job.id, describe(exc))
                self.send(error_message(job.id, exc))
            else:
                log.info("job %s committed %s", job.id, job.path)
                self.send({"op": "done", "id": job.id, "manifest": manifest.to_json().decode()})
            finally:
                close_fd(lock_fd)
                with self.lock:
                    self.jobs.pop(job.id, None)

    def finish(self) -> None:
        for arena in self.arenas.values():
            arena.close(unlink=False)
        self.arenas.clear()
        self.storages.close()
        if self.orphaned and self.staging_prefix:  # nobody else will remove the dead trainer's staging files
            for path in glob.glob(glob.escape(self.staging_prefix) + "-*"):
                try:
                    os.unlink(path)
                except OSError:
                    pass


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    parent = int(args[args.index("--parent") + 1]) if "--parent" in args else os.getppid()
    prefix = args[args.index("--staging-prefix") + 1] if "--staging-prefix" in args else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    sys.stdout = sys.stderr
    logging.basicConfig(
        level=os.environ.get("UCP_WRITER_LOG", "WARNING"),
        stream=sys.stderr,
        format="%(asctime)s ucp writer %(process)d: %(message)s",
    )
    wp = _WriterProcess(parent, out, prefix)
    worker = threading.Thread(target=wp.run_jobs, name="ucp-writer-jobs")
    worker.start()
    threading.Thread(target=wp.watch_parent, name="ucp-writer-watch", daemon=True).start()
    reader = threading.Thread(target=_read_loop, args=(wp,), name="ucp-writer-commands", daemon=True)
    reader.start()
    wp.send({"op": "ready"})
    worker.join()
    log.info("jobs done")
    wp.finish()
    log.info("exiting")
    os._exit(0)  # the command reader may still block on a pipe a forked child of the trainer holds open


def _read_loop(wp: _WriterProcess) -> None:
    stream = sys.stdin.buffer
    closed = False
    try:
        for line in stream:
            msg = json.loads(line)
            if msg.get("op") == "close":
                closed = True
                break
            wp.dispatch(msg)
    except Exception as exc:  # pragma: no cover - a protocol bug
        log.error("command stream failed: %s", describe(exc))
    wp.stop(orphaned=not closed)


_ids = itertools.count(1)


def next_job_id() -> int:
    return next(_ids)


if __name__ == "__main__":
    main()
