"""``mode="thread"``: jobs run one after another on a writer thread of the training process."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any

from ucp.saving.background.execute import StorageCache, execute
from ucp.saving.background.handshake import abandon
from ucp.saving.background.image import DirectImage, Progress
from ucp.saving.background.job import WriteJob
from ucp.saving.staging import Arena, StagingPool
from ucp.store.commit import close_fd

log = logging.getLogger(__name__)


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
