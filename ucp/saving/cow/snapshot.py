"""Copy-on-write snapshots of host tensors: ``async_save`` returns before copying, yet saves the state as called.

``AsyncSaver(snapshot="cow")`` (the default where Linux allows it) does not copy the
state dict before returning. It write-protects the pages of the host tensors to save
(a write-protect userfaultfd, :mod:`ucp.saving.cow.userfaultfd`) and hands them to a helper
process (:mod:`ucp.saving.cow.helper`), which copies them into the staging arena in the
background and lifts the protection block by block. Training goes on at once; a
write to a block not copied yet — by an optimizer step, ``.data``, numpy, a
``read(2)`` into the tensor, anything — waits until the helper has copied that block
(a fraction of a millisecond), so the snapshot is exactly the state at the call.

What stays with a copy made before returning (as with ``snapshot="sync"``): the
safetensors header and padding, and pieces whose memory cannot be protected —
CUDA tensors, non-contiguous views, conjugate/negative views, memory outside private
anonymous mappings (shared memory, ``mmap=True`` loads and other file mappings: other
mappings can write them), or memory another snapshot in flight still protects.

Writes need no wait; freeing or resizing a saved tensor's storage must wait for
``handle.wait_copied()`` (done before that, the save fails naming the tensor).
"""

from __future__ import annotations

import array
import bisect
import ctypes
import logging
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

import kernels
from ucp.errors import CowUnavailable
from ucp.format.tree import Leaf
from ucp.saving.background.image import Progress, SnapshotAborted
from ucp.saving.cow.helper import receive_message, send_message
from ucp.saving.cow.userfaultfd import PAGE, WriteProtector, unavailable
from ucp.saving.plan import SavePlan
from ucp.saving.snapshot import image_sources
from ucp.saving.staging import MemfdArena

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 30.0  # seconds for the helper to start and prove it can read our memory
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))  # the helper's copy threads (process_vm_readv in parallel)
PROTECT_TIMEOUT = 60.0  # seconds for the helper to write-protect a snapshot's pages
CLOSE_TIMEOUT = 10.0  # seconds for the helper to exit when its saver closes
_PR_SET_PTRACER = 0x59616D61  # prctl: let the helper read our memory under Yama ptrace_scope=1


def cow_unavailable() -> str | None:
    """Why this process cannot take copy-on-write snapshots, or None when it can."""
    if os.environ.get("UCP_COW", "1") == "0":
        return "UCP_COW=0"
    return unavailable()


@dataclass
class _Pending:
    """A snapshot the helper is copying: what to tell when it progresses, ends or fails."""

    progress: Progress
    done: Future
    names: list[str]  # the plan's piece names, in file order (the helper's errors give a piece index)
    protected: threading.Event = field(default_factory=threading.Event)
    protect_error: str | None = None
    keep: list[torch.Tensor] = field(default_factory=list)  # the source tensors stay alive until copied


class CowSnapshots:
    """The helper process of one saver and the snapshots it is copying.

    Any failure between sending a job and its "protected" answer (the helper gone or stuck, an
    interrupt) kills the helper: its descriptors close, which releases every protected page and
    guarantees it writes no arena any more, and later saves copy before returning. A job abandoned
    after that point (its writer failed) keeps its arena out of the pool until the helper ends it
    (``arena.busy``), so the next save never shares memory with a copy still running.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._pending: dict[int, _Pending] = {}
        self._hello: Future | None = None
        self._next_id = 0
        self._dead: str | None = None
        self.faulted_blocks = 0  # blocks the helper copied early because this process wrote to them
        self.pause_before_copy = 0.0  # tests: the helper waits this long before copying (writes then fault)

    # -- the helper ----------------------------------------------------------------------------------
    def _ensure_helper(self) -> socket.socket:
        with self._lock:
            if self._dead is not None:
                raise CowUnavailable(self._dead)
            if self._sock is not None:
                return self._sock
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "ucp.saving.cow.helper", str(theirs.fileno()), str(COPY_THREADS)],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    env=_helper_env(),
                )
            except OSError as exc:
                ours.close()
                self._dead = f"the copy-on-write helper could not be started: {exc}"
                log.warning("%s; saves copy before returning instead", self._dead)
                raise CowUnavailable(self._dead) from None
            finally:
                theirs.close()
            _allow_reading(self._proc.pid)
            self._sock = ours
            self._hello = Future()
            threading.Thread(target=self._read, args=(ours,), name="ucp-cow-reader", daemon=True).start()
        probe = ctypes.create_string_buffer(b"ucp-cow-probe", 16)
        try:
            with self._send_lock:
                send_message(
                    ours, {"op": "hello", "pid": os.getpid(), "address": ctypes.addressof(probe), "length": 16}
                )
            answer = self._hello.result(HELLO_TIMEOUT)
        except Exception as exc:
            self._kill(f"the copy-on-write helper did not start: {exc}")
            raise CowUnavailable(self._dead or str(exc)) from None
        if answer != probe.raw.hex():
            self._kill(f"the copy-on-write helper cannot read this process's memory: {answer}")
            raise CowUnavailable(self._dead or "")
        return ours

    def _kill(self, why: str) -> None:
        """Stop the helper for good (see the class docstring); later saves copy before returning."""
        with self._lock:
            if self._dead is None:
                self._dead = why
                log.warning("%s; saves copy before returning instead", why)
            proc, sock = self._proc, self._sock
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the reader thread fails what is still pending
            except OSError:
                pass

    def _read(self, sock: socket.socket) -> None:
        """The reader thread: the helper's progress, completions and failures."""
        why = "the copy-on-write helper process exited"
        try:
            while True:
                received = receive_message(sock)
                if received is None:
                    break
                message, _binary, _fds = received
                if "hello" in message:
                    assert self._hello is not None
                    self._hello.set_result(message["hello"] or message.get("error"))
                    continue
                self._on_message(message)
        except OSError as exc:
            why = f"lost the copy-on-write helper: {exc}"
        if self._proc is not None and self._proc.poll() is not None and self._proc.returncode:
            why += f" (exit status {self._proc.returncode})"
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(RuntimeError(why))
        with self._lock:
            pending, self._pending = self._pending, {}
            if self._dead is None:
                self._dead = why
        for p in pending.values():
            p.protect_error = p.protect_error or why
            p.protected.set()
            self._finish(p, why)

    def _on_message(self, message: dict[str, Any]) -> None:
        with self._lock:
            p = self._pending.get(message["id"])
        if p is None:
            return
        if "protected" in message:
            if not message["protected"]:
                p.protect_error = message.get("error") or "write-protecting failed"
            p.protected.set()
        elif "ready" in message:
            p.progress.advance(message["ready"])
        elif "done" in message or "error" in message:
            p.progress.crcs.update({int(i): int(v) for i, v in message.get("crcs", {}).items()})
            with self._lock:
                self._pending.pop(message["id"], None)
                self.faulted_blocks += message.get("faulted", 0)
            error = message.get("error")
            if error is not None and message.get("piece") is not None:
                error = (
                    f"tensor {p.names[message['piece']]!r}: {error} (was its storage freed or resized before "
                    "the snapshot was copied? wait for handle.wait_copied() first)"
                )
            self._finish(p, error)

    @staticmethod
    def _finish(p: _Pending, error: str | None) -> None:
        p.keep.clear()
        if error is None:
            p.progress.advance(p.progress.total)
            if not p.done.done():
                p.done.set_result(None)
        else:
            p.progress.fail(error)  # the writer gives up; the save fails naming this
            if not p.done.done():
                p.done.set_exception(SnapshotAborted(error))

    def prepare(self, arena: MemfdArena) -> None:
        """Start the helper and have it map ``arena`` now, so the first snapshot does not wait for either."""
        try:
            sock = self._ensure_helper()
            with self._send_lock:
                send_message(sock, {"op": "map", "arena": arena.token, "capacity": arena.capacity}, fds=[arena.fd])
        except (CowUnavailable, OSError) as exc:
            log.info("copy-on-write helper not prepared: %s", exc)

    def forget(self, arena: Any) -> None:
        """The pool dropped ``arena``: the helper unmaps it."""
        token = getattr(arena, "token", None)
        if token is None or self._sock is None or self._dead is not None:
            return
        try:
            with self._send_lock:
                send_message(self._sock, {"op": "forget", "arena": token})
        except OSError:
            pass

    def close(self) -> None:
        """Stop the helper (the saver waited for its saves first; copies still running then fail)."""
        with self._lock:
            sock, proc = self._sock, self._proc
            self._sock = None
        if sock is not None:
            try:
                with self._send_lock:
                    send_message(sock, {"op": "stop"})
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if proc is not None:
            try:
                proc.wait(timeout=CLOSE_TIMEOUT)
            except subprocess.TimeoutExpired:  # a stuck (or stopped) helper
                proc.kill()
                proc.wait()
        if sock is not None:
            sock.close()

    # -- one snapshot ----------------------------------------------------------------------------------
    def start(self, plan: SavePlan, leaves: Sequence[Leaf], arena: MemfdArena, progress: Progress) -> Future:
        """Take the snapshot of ``plan``'s pieces into ``arena``; returns when it is protected.

        The returned future completes once every byte is in the arena (``progress`` says how far
        along, for the writer). Raises :class:`CowUnavailable` when the helper cannot take the job;
        the caller then copies itself (the helper is gone by then: nothing else writes the arena).
        """
        sock = self._ensure_helper()
        sources = list(image_sources(plan, leaves, arena))  # (piece index, tensor) in file order
        try:
            protector = WriteProtector.create()
        except OSError as exc:  # e.g. out of descriptors: this save copies
            raise CowUnavailable(f"no userfaultfd for this snapshot: {exc}") from None
        try:
            protectable = [(i, t) for i, t in sources if _protectable(t)]
            runs, covered = _register(protector, protectable)
            checksummed = set(covered)
            keep: list[torch.Tensor] = []
            words = array.array("Q")
            for start, end in runs:
                words.extend((start, end))
            for i, src in sources:  # in file order: the helper's pieces, and those copied here
                p = plan.pieces[i]
                if i in covered:
                    keep.append(src)
                    words.extend((src.data_ptr(), p.length, p.offset, p.offset + p.length))
                else:
                    if _read_in_place(src):  # one pass: copied and checksummed (the writer reads it no more)
                        progress.crcs[i] = kernels.copy_crc32c(arena.tensor(p.length, p.offset), _bytes(src))
                        checksummed.add(i)
                    elif p.length:
                        dst = arena.tensor(p.length, p.offset).view(src.dtype)
                        dst.view(src.shape).copy_(src)
                    words.extend((0, p.length, p.offset, p.offset + p.length))
            # Before the helper may advance the progress: the helper's pieces' CRCs come with its "done".
            progress.checksummed = frozenset(checksummed)
            pending = _Pending(progress=progress, done=Future(), names=[p.name for p in plan.pieces], keep=keep)
            with self._lock:
                self._next_id += 1
                job_id = self._next_id
                self._pending[job_id] = pending
            arena.busy = pending.done  # the pool takes the arena back only once the helper is done with it
            try:
                with self._send_lock:
                    send_message(
                        sock,
                        {
                            "op": "job",
                            "id": job_id,
                            "pid": os.getpid(),
                            "features": protector.features,
                            "arena": arena.token,
                            "capacity": arena.capacity,
                            "runs": len(runs),
                            "pause": self.pause_before_copy,
                        },
                        words.tobytes(),
                        fds=[protector.fd, arena.fd],
                    )
            except BaseException as exc:
                self._abandon(job_id, f"sending the snapshot to the copy-on-write helper failed: {exc!r}")
                if isinstance(exc, OSError):
                    raise CowUnavailable(self._dead or str(exc)) from None
                raise
        finally:
            protector.close()  # the helper holds it now; if it dies, every protected page is released
        try:
            answered = pending.protected.wait(PROTECT_TIMEOUT)
        except BaseException as exc:  # an interrupt while the helper protects
            self._abandon(job_id, f"interrupted while the copy-on-write helper protected the snapshot: {exc!r}")
            raise
        if not answered:
            self._abandon(job_id, f"the copy-on-write helper did not protect a snapshot within {PROTECT_TIMEOUT}s")
        elif pending.protect_error is not None:  # the helper refused the job and holds nothing of it
            self._drop(job_id, pending.protect_error)
        if pending.protect_error is not None or not answered:
            raise CowUnavailable(pending.protect_error or self._dead or "")
        return pending.done

    def _abandon(self, job_id: int, why: str) -> None:
        """A job the helper may hold but the save gives up on: kill the helper (nothing writes the arena
        any more, every page is released), then drop the job. The caller fails or redoes the snapshot."""
        self._drop(job_id, why)  # first, so the reader thread does not fail its progress as the helper goes
        self._kill(why)

    def _drop(self, job_id: int, why: str) -> None:
        with self._lock:
            pending = self._pending.pop(job_id, None)
        if pending is not None:
            pending.protect_error = pending.protect_error or why
            pending.keep.clear()
            if not pending.done.done():
                pending.done.set_exception(SnapshotAborted(why))  # frees the arena (arena.busy)


def _read_in_place(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes, as saved, are its memory as it lies (a host tensor, contiguous, no conj/neg bit)."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor :func:`_read_in_place` accepts, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _protectable(t: torch.Tensor) -> bool:
    """Whether the helper can copy ``t``'s bytes straight from its memory."""
    return t.device.type == "cpu" and t.numel() > 0 and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _register(
    protector: WriteProtector, pieces: list[tuple[int, torch.Tensor]]
) -> tuple[list[tuple[int, int]], set[int]]:
    """Register the page ranges the pieces' memory spans; returns those ranges and the pieces they cover.

    Ranges outside private anonymous memory, and those the kernel refuses (memory another snapshot
    protects), leave their pieces to be copied by the caller.
    """
    spans = sorted(
        (
            (t.data_ptr() // PAGE * PAGE, -(-(t.data_ptr() + t.numel() * t.element_size()) // PAGE) * PAGE, i)
            for i, t in pieces
        )
    )
    groups: list[tuple[int, int, list[int]]] = []
    for start, end, i in spans:
        if groups and start <= groups[-1][1]:
            s, e, members = groups[-1]
            groups[-1] = (s, max(e, end), members + [i])
        else:
            groups.append((start, end, [i]))
    runs, covered = [], set()
    private = _private_anonymous()
    starts = [a for a, _ in private]
    for start, end, members in groups:
        if not _covered_by(private, starts, start, end):
            continue  # shared or file-backed memory: others can write it where we cannot protect it
        try:
            protector.register(start, end - start)
        except OSError as exc:
            log.debug("copy-on-write: cannot register [0x%x, 0x%x): %s; copying it now", start, end, exc)
            continue
        runs.append((start, end))
        covered.update(members)
    return runs, covered


def _private_anonymous() -> list[tuple[int, int]]:
    """This process's private anonymous mappings (heap, malloc's mmaps), sorted, from /proc/self/maps.

    Only there is a write-protected page safe from every other writer: shared memory and files can
    be written through other mappings (another process, ``write(2)`` to the file) our page tables
    do not cover.
    """
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) > 5 else ""
            if fields[1][3] == "p" and fields[4] == "0" and (not path or path == "[heap]" or path.startswith("[anon:")):
                a, b = fields[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    return out


def _covered_by(ranges: list[tuple[int, int]], starts: list[int], start: int, end: int) -> bool:
    """Whether sorted, disjoint ``ranges`` cover ``[start, end)`` without a gap."""
    at = bisect.bisect_right(starts, start) - 1
    pos = start
    while 0 <= at < len(ranges) and ranges[at][0] <= pos < ranges[at][1]:
        pos = ranges[at][1]
        if pos >= end:
            return True
        at += 1
    return False


def _allow_reading(pid: int) -> None:
    """Under Yama ``ptrace_scope=1`` a child may not read its parent's memory unless the parent says so."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _helper_env() -> dict[str, str]:
    """The helper imports ``ucp`` from where this process did (a source tree need not be installed)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env
