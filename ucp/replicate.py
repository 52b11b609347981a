"""Tiered checkpoints: copy each committed local checkpoint to an object store in the background.

``CheckpointManager(local_root, remote="s3://bucket/run", ...)`` commits to local disk at disk
speed (what training waits for); a :class:`Replicator` thread then uploads each committed
checkpoint to ``<remote>/step-NNNNNNNN`` with the object-store commit (data files, manifest last:
``ucp.store.commit``), moves the remote ``latest`` and applies the remote retention
(``ucp.manager_remote``). Local retention runs only after a checkpoint is replicated, so a step is
never deleted locally before its remote copy is complete. A node that dies loses nothing that had
been replicated; a replication that fails is logged, recorded in :attr:`Replicator.failed` and raised
by :meth:`Replicator.wait` (the local checkpoint stays, and later steps replicate as usual); what it
left under its remote prefix is deleted, at once or, where the store was unreachable, after the next
step commits (:func:`ucp.manager_remote.discard_failed`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable

from ucp.errors import CheckpointError
from ucp.format.manifest import MANIFEST_NAME
from ucp.store import commit as _commit

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # bytes read from a local data file per write to the upload (storages without put_file)
CONCURRENCY = 4  # parts of one file uploaded at once behind training (S3Options.concurrency is for saves and loads)


def replicate(local_dir: str, remote_root: str, name: str, storage_options: dict[str, Any] | None = None) -> int:
    """Upload the committed checkpoint at ``local_dir`` as ``<remote_root>/<name>`` (manifest last); its bytes.

    The local manifest is read first and only the files it lists are sent, so a checkpoint replaced
    locally meanwhile fails the copy (a missing or resized file) instead of mixing two saves."""
    from ucp.format.manifest import parse_manifest
    from ucp.manager_remote import open_root

    manifest_path = os.path.join(local_dir, MANIFEST_NAME)
    with open(manifest_path, "rb") as f:
        manifest_bytes = f.read()
    manifest = parse_manifest(manifest_bytes, source=manifest_path)
    total = 0
    with open_root(remote_root, storage_options) as storage:
        temp = _commit.make_temp_dir(storage, name)  # an object store: the final prefix, marked in progress
        try:
            for file, info in manifest.files.items():
                total += upload_file(storage, os.path.join(local_dir, file), f"{temp}/{file}", info.size)
            if temp == name:
                storage.write_small(f"{name}/{MANIFEST_NAME}", manifest_bytes)
                try:
                    storage.remove_file(f"{name}/{_commit.SAVING_MARKER}")
                except (OSError, CheckpointError):
                    pass
            else:  # a storage that renames (a mounted remote directory): the usual commit
                storage.write_small(f"{temp}/{MANIFEST_NAME}", manifest_bytes)
                storage.rename(temp, name)
        except BaseException:
            _commit.abort(storage, temp)
            raise
    return total + len(manifest_bytes)


def upload_file(storage: Any, path: str, rel: str, size: int) -> int:
    """Copy the committed local file ``path`` (``size`` bytes, as its manifest says) to ``rel`` of ``storage``;
    its size. An object store reads the file itself (:meth:`ucp.store.s3.S3Storage.put_file`), ``CONCURRENCY``
    parts at once: no Python loop or copy of the bytes on the training process's GIL, and no checksum of
    them here (their CRC-32Cs are in the manifest, checked by every load). Other storages get it streamed
    through their writer in ``CHUNK`` reads. A file whose size is not ``size`` fails the copy (replaced
    meanwhile), and a failed upload leaves no partial object behind."""
    if os.path.getsize(path) != size:
        raise CheckpointError(
            f"{path} has {os.path.getsize(path)} bytes, its manifest says {size}: changed since its commit",
            file=os.path.basename(path),
        )
    put_file = getattr(storage, "put_file", None)
    if put_file is not None:
        put_file(rel, path, concurrency=CONCURRENCY)
        return size
    writer = storage.open_writer(rel, size)
    try:
        with open(path, "rb", buffering=0) as src:
            buf = bytearray(min(CHUNK, max(size, 1)))
            view = memoryview(buf)
            sent = 0
            while n := src.readinto(buf):
                writer.write(view[:n])  # not borrowed: copied before the buffer is refilled
                sent += n
        if sent != size:
            raise CheckpointError(
                f"{path} has {sent} bytes, its manifest says {size}: changed while replicating",
                file=os.path.basename(path),
            )
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return size


class Replicator:
    """One background thread replicating committed steps in the order they were committed.

    Each step's outcome: :attr:`replicated` (name -> seconds) or :attr:`failed` (name -> the error, one
    line); :meth:`wait` raises the first failure since the last wait. A failed step's remote prefix is
    discarded (:func:`ucp.manager_remote.discard_failed`: every object under it, ``latest`` never left
    naming it) by the thread on which the replication failed (rank 0's, for a node-local tier), and again
    after each later step commits, until a discard succeeds: an unreachable store is cleaned once it is
    back, and an upload another rank still had in flight for the failed step is removed too.
    """

    def __init__(
        self,
        local_root: str,
        remote_root: str,
        *,
        remote_keep_last: int | None,
        storage_options: dict[str, Any] | None,
        after_local: Callable[[str, set[str]], None] | None = None,
        rank: int | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.local_root, self.remote_root = local_root, remote_root
        # None: rank 0 uploads every file from a shared tier; a rank: it uploads its own files
        # (ucp.tiered.replicate_rank) and only rank 0 commits and moves ``latest``
        self.rank, self.timeout = rank, timeout
        self.remote_keep_last = remote_keep_last
        self.storage_options = storage_options
        self.after_local = after_local  # local retention, run once a step is safe remotely
        self._queue: queue.Queue[tuple[int, str] | None] = queue.Queue()
        self._waiting: list[str] = []  # names submitted and not yet replicated, oldest first
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._errors: list[BaseException] = []
        self.replicated: dict[str, float] = {}  # name -> seconds its replication took
        self.failed: dict[str, str] = {}  # name -> why its replication failed (until it replicates)
        self._unclean: set[str] = set()  # failed names whose remote prefix may still hold objects
        self._thread = threading.Thread(target=self._run, name="ucp-replicate", daemon=True)
        self._thread.start()

    def submit(self, step: int, name: str) -> None:
        with self._lock:
            self._pending += 1
            self._waiting.append(name)
        self._queue.put((step, name))

    def _run(self) -> None:
        from ucp.manager_remote import after_commit as remote_after_commit

        while True:
            item = self._queue.get()
            if item is None:
                return
            step, name = item
            t0 = time.perf_counter()
            try:
                local_dir = os.path.join(self.local_root, name)
                if self.rank is None:
                    replicate(local_dir, self.remote_root, name, self.storage_options)
                else:
                    from ucp.tiered import replicate_rank

                    replicate_rank(
                        local_dir, self.remote_root, name, self.rank, self.storage_options, timeout=self.timeout
                    )
                if not self.rank:
                    remote_after_commit(self.remote_root, step, name, self.remote_keep_last, self.storage_options)
                    self._discard(drop=True)
                self.replicated[name] = time.perf_counter() - t0
                self.failed.pop(name, None)
                with self._lock:
                    self._waiting.remove(name)
                    waiting = set(self._waiting)
                if self.after_local is not None:
                    self.after_local(name, waiting)
            except BaseException as exc:  # noqa: BLE001 - kept for wait(); the local checkpoint stays
                log.error("replicating %s to %s failed: %s", name, self.remote_root, exc)
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                if not self.rank:
                    self._unclean.add(name)
                    self._discard(drop=self.rank is None)  # other ranks may still upload: swept again later
                with self._lock:
                    self._errors.append(exc)
            finally:
                with self._lock:
                    if name in self._waiting and name not in self.replicated:
                        self._waiting.remove(name)
                    self._pending -= 1
                    self._idle.notify_all()

    def _discard(self, *, drop: bool) -> None:
        """Discard the remote prefixes of failed steps (best effort: logged); ``drop``: forget those done."""
        from ucp.manager_remote import discard_failed

        for name in sorted(self._unclean):
            try:
                if discard_failed(self.remote_root, name, self.storage_options):
                    log.info("removed what the failed replication of %s left under %s", name, self.remote_root)
            except Exception as exc:  # noqa: BLE001 - the store may be unreachable: tried again later
                log.warning(
                    "could not yet remove %s/%s (tried again after the next step): %s", self.remote_root, name, exc
                )
                continue
            if drop:
                self._unclean.discard(name)

    def wait(self) -> None:
        """Wait until every submitted step is replicated; raise the first failure since the last wait."""
        with self._lock:
            while self._pending:
                self._idle.wait()
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
