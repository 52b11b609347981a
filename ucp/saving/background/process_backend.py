"""``mode="process"``, the training side: feeds jobs to the writer process and collects the outcomes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import ucp
from ucp.errors import CommitError
from ucp.format.manifest import parse_manifest
from ucp.saving.background.handshake import abandon
from ucp.saving.background.image import Progress
from ucp.saving.background.job import WriteJob, rebuild_error
from ucp.saving.staging import Arena, StagingPool
from ucp.store.commit import close_fd

log = logging.getLogger(__name__)

PROGRESS_STEP = 8 << 20  # process mode: tell the writer about snapshot progress at most every this many bytes


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
                raise CommitError(
                    f"the writer process (pid {proc.pid}) exited with code {code} while starting",
                    ranks=(),  # this process's own writer: no save (hence no rank) yet
                    reason=f"writer exited with code {code}",
                )
            if time.monotonic() > deadline:
                raise CommitError(
                    f"the writer process (pid {proc.pid}) did not start within {timeout:.0f}s",
                    ranks=(),
                    reason=f"writer did not start within {timeout:.0f}s",
                )
        return proc.pid

    def _ensure(self) -> subprocess.Popen[bytes]:
        with self._state_lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
            here = os.path.dirname(os.path.dirname(os.path.abspath(ucp.__file__)))  # the tree holding ucp
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ucp.saving.background.worker",
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
                raise CommitError(
                    f"the writer process (pid {proc.pid}) is gone: {exc}", ranks=(), reason=f"writer gone: {exc}"
                ) from None

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
        crcs_sent: set[int] = set()

        def forward(ready: int) -> None:
            # Small messages, at most one per PROGRESS_STEP bytes copied. A dead writer shows up in the result.
            # The first one declares the pieces the snapshot checksums; each carries the CRCs taken since the last.
            if ready >= sent[0] + PROGRESS_STEP or (ready == progress.total and ready > sent[0]):
                msg: dict[str, Any] = {"op": "progress", "id": job.id, "ready": ready}
                if not sent[0]:
                    msg["checksummed"] = sorted(progress.checksummed)
                new = {i: v for i, v in list(progress.crcs.items()) if i not in crcs_sent}
                if new:
                    msg["crcs"] = {str(i): v for i, v in new.items()}
                    crcs_sent.update(new)
                sent[0] = ready
                try:
                    self._send(proc, msg)
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
            fut.set_exception(CommitError(why, ranks=(job.rank,), reason=why))

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
