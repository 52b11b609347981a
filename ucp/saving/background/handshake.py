"""The file handshake that commits a background save: ranks meet in the temporary directory, no collectives.

Background writers must not run collectives (gloo is not safe next to the training loop's own), so:

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
:class:`HandshakeCommit` is this protocol behind the :class:`~ucp.store.commit.Committer` interface.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time

from ucp.errors import CheckpointError, CommitError
from ucp.format.manifest import Manifest, now_utc
from ucp.saving.background.job import WriteJob, describe
from ucp.store import commit as _commit
from ucp.store.reader import read_manifest
from ucp.store.storage import Storage

log = logging.getLogger(__name__)

REPORT_RE = re.compile(r"^\.report-rank-(\d{5})\.json$")
POLL_MIN, POLL_MAX = 0.005, 0.1  # seconds between looks at the temporary directory


def alive_name(rank: int) -> str:
    return f".alive-rank-{rank:05d}"


def hold_alive(storage: Storage, job: WriteJob) -> int | None:
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


def rank_dead(storage: Storage, job: WriteJob, rank: int) -> bool:
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


def drop_alive_files(storage: Storage, job: WriteJob) -> None:
    """Rank 0, before the commit: remove the liveness files so the checkpoint holds only its data."""
    if not storage.supports_locks:  # no liveness files were made (see hold_alive)
        return
    for rank in range(job.world_size):
        try:
            storage.remove_file(f"{job.temp}/{alive_name(rank)}")
        except OSError:
            pass


def commit_reports(storage: Storage, job: WriteJob, reports: list[_commit.RankReport]) -> tuple[Manifest, bytes]:
    """Rank 0: build the manifest from every rank's report, drop the liveness files and commit ``job``'s
    temporary directory in ``storage``; returns the manifest and its bytes as written."""
    manifest = _commit.build_manifest(
        reports,
        world_size=job.world_size,
        step=job.step,
        metadata=job.metadata,
        mesh=job.mesh,
        created=now_utc(),
    )
    drop_alive_files(storage, job)
    return manifest, _commit.commit(storage, job.temp, job.name, manifest)


def rank_failed(storage: Storage, job: WriteJob, rank: int, error: str) -> CommitError:
    """The error that fails ``job``'s save because ``rank`` reported ``error``."""
    return CommitError(
        f"save of {storage.describe(job.name)} failed on rank {rank}: {error}", ranks=(rank,), reason=error
    )


def report_name(rank: int) -> str:
    return f".report-rank-{rank:05d}.json"


ABANDONED_NAME = ".abandoned.json"  # rank 0's reason for giving up a save, for the other ranks to read
ACK_TIMEOUT = 2.0  # seconds rank 0 waits for the waiting ranks to read that reason before removing the directory


def ack_name(rank: int) -> str:
    return f".abandoned-seen-rank-{rank:05d}"


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


def abandon(job: WriteJob, why: str = "snapshot failed") -> None:
    """A job that never reached (or never ran on) a writer: remove its temp dir (rank 0), or report the
    failure into it (other ranks) so rank 0 gives up at once. A node-local tier's job reports on the store."""
    if job.handshake is not None:
        from ucp.saving.background import store_handshake

        store_handshake.abandon(job, why)
        return
    storage, _ = job.open_storage()
    with storage:
        if job.rank == 0:
            _commit.abort(storage, job.temp)
        else:
            try:
                publish_report(storage, job, _commit.RankReport(rank=job.rank, error=why))
            except CommitError:
                pass


class HandshakeCommit(_commit.Committer):
    """The commit of one background job through files in its temporary directory (see the module docstring).

    Rank 0 collects the other ranks' reports, builds and commits the manifest; the other ranks publish
    theirs and wait for that commit. A report with an error reaches rank 0 (it then gives up at once),
    or, on rank 0, abandons the save with that reason for the others to read.
    """

    def __init__(self, storage: Storage, job: WriteJob) -> None:
        self.storage, self.job = storage, job

    def commit(self, report: _commit.RankReport) -> Manifest:
        storage, job = self.storage, self.job
        if job.rank != 0:
            if report.error is not None:
                try:  # tell rank 0, so that it gives up now rather than at its timeout
                    publish_report(storage, job, report)
                except (CommitError, OSError) as exc:
                    log.debug("could not report rank %d's error: %s", job.rank, exc)
                raise rank_failed(storage, job, job.rank, report.error)
            publish_report(storage, job, report)
            return wait_for_commit(storage, job, report)
        if report.error is not None:
            give_up(storage, job, report.error)
            raise rank_failed(storage, job, 0, report.error)
        try:
            manifest, _ = commit_reports(storage, job, [report] + collect_reports(storage, job))
        except BaseException as exc:
            give_up(storage, job, describe(exc))
            raise
        return manifest


def give_up(storage: Storage, job: WriteJob, error: str) -> None:
    """Rank 0 abandons a save: leave its reason in the temporary directory for the ranks waiting on the
    commit, give them up to ACK_TIMEOUT to read it (ranks that died or failed are not waited for),
    then remove the directory. Best effort: never masks ``error`` (the reason, as text)."""
    if job.world_size > 1:
        try:
            final = f"{job.temp}/{ABANDONED_NAME}"
            storage.write_small(final + ".part", json.dumps({"error": error}).encode())
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
            "rank 0 abandoned the save (its error says why)",
            ranks=(0,),
            reason="rank 0 abandoned the save",
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
                raise rank_failed(storage, job, r.rank, r.error)
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
                "(their writer's lock is gone and they never reported)",
                ranks=dead,
                reason="died while writing",
            )
        if time.monotonic() > deadline:
            missing = sorted(want - set(got))
            raise CommitError(
                f"save of {storage.describe(job.name)}: rank(s) {missing[:8]} did not report within "
                f"{job.commit_timeout:.0f}s (crashed, or much slower?)",
                ranks=missing,
                reason=f"did not report within {job.commit_timeout:.0f}s",
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
        if job.temp == job.name and _manifest_holds(storage, job, report):  # written in place (object stores)
            return _committed(storage, job)
        reason = abandoned_because(storage, job)
        if reason is not None:
            raise CommitError(
                f"rank 0 did not commit {storage.describe(job.name)}: {reason}; rank {job.rank}'s data was written",
                ranks=(0,),
                reason=reason,
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
                f"rank {job.rank}'s data was written",
                ranks=(0,),
                reason="rank 0 did not commit",
            )
        if rank_dead(storage, job, 0):
            if job.temp_identity is not None and identity(storage, job.name) == job.temp_identity:
                return _committed(storage, job)
            raise CommitError(
                f"rank 0 died before committing {storage.describe(job.name)}; rank {job.rank}'s data was written",
                ranks=(0,),
                reason="rank 0 died before committing",
            )
        if time.monotonic() > deadline:
            raise CommitError(
                f"rank 0 did not commit {storage.describe(job.name)} within {job.commit_timeout:.0f}s",
                ranks=(0,),
                reason=f"no commit within {job.commit_timeout:.0f}s",
            )
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
    return manifest_holds(m, job, report)


def manifest_holds(m: Manifest, job: WriteJob, report: _commit.RankReport) -> bool:
    """Whether manifest ``m`` is this save's (its step) and holds exactly this rank's pieces."""
    if m.step != job.step:
        return False
    if report.file is None:
        return all(name in m.tensors for name, _, _ in job.tensors)
    mine = {(name, p.offset, p.crc32c) for name, p in report.pieces}
    theirs = {(name, p.offset, p.crc32c) for name, t in m.tensors.items() for p in t.pieces if p.file == report.file}
    return mine == theirs and report.file in m.files and m.files[report.file].size == report.file_size
