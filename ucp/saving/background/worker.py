"""``python -m ucp.saving.background.worker --parent PID``: the writer process itself (``mode="process"``)."""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

from ucp.saving.background.execute import StorageCache, execute
from ucp.saving.background.image import Progress
from ucp.saving.background.job import WriteJob, describe, error_message
from ucp.saving.staging import SharedArena
from ucp.store.commit import close_fd, lock_dir

log = logging.getLogger(__name__)


class _WriterProcess:
    """``python -m ucp.saving.background.worker --parent PID``: runs jobs from stdin until told to close or orphaned."""

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
                progress = entry[1]
                if "checksummed" in msg:  # before the first advance, as in the training process
                    progress.checksummed = frozenset(int(i) for i in msg["checksummed"])
                progress.crcs.update({int(i): int(v) for i, v in msg.get("crcs", {}).items()})
                progress.advance(int(msg["ready"]))
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

    def arena_free(self, job_id: int) -> None:
        """Tell the trainer the job's data file is written: its arena may be reused."""
        self.send({"op": "arena_free", "id": job_id})

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
                    manifest = execute(job, storage, arena, progress, functools.partial(self.arena_free, job.id))
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


if __name__ == "__main__":
    main()
