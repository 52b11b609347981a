"""The copy-on-write snapshot helper: a small process that copies a trainer's tensors out of its memory.

Started by :class:`ucp.cow.CowSnapshots` (``python -m ucp.cow_helper FD``) and fed
through the Unix socket ``FD``. For each snapshot job it receives a write-protect
userfaultfd of the trainer's memory (:mod:`ucp.userfaultfd`), the staging arena (a
memfd), and the pieces to copy. It then:

1. write-protects the job's registered ranges and acknowledges (``save`` returns now);
2. copies the pieces into the arena in file order, 2 MiB of trainer memory at a time
   (``process_vm_readv``), lifting the protection of each block once it is copied and
   reporting how much of the file image is ready (the writer thread follows);
3. between blocks, serves the trainer's write faults: a block written before its turn
   is copied first, then released.

A block is copied exactly once, while still protected, so the arena holds every byte
as it was when ``save`` was called. The helper is a separate process so that it never
needs the trainer's GIL: a trainer thread blocked on a protected page holding the GIL
cannot stall it. If it dies, its descriptors close and the kernel releases every
blocked writer (that snapshot fails; the trainer is never left hanging).

Standard library only (no torch): it starts in a fraction of a second.
"""

from __future__ import annotations

import array
import bisect
import json
import mmap
import os
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .userfaultfd import WriteProtector, read_process_memory

BLOCK = 2 << 20  # trainer memory is copied and released in aligned blocks of this size
REPORT_EVERY = 32 << 20  # bytes of file image between progress messages
_HEADER = struct.Struct("<II")  # JSON length, binary length


# -- framing (shared with the trainer side) ---------------------------------------------------------


def send_message(sock: socket.socket, message: dict[str, Any], binary: bytes = b"", fds: list[int] | None = None) -> None:
    """One message: a header (with any descriptors attached), JSON, then raw bytes."""
    body = json.dumps(message).encode()
    header = _HEADER.pack(len(body), len(binary))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(body)
    if binary:
        sock.sendall(binary)


def receive_message(sock: socket.socket) -> tuple[dict[str, Any], bytes, list[int]] | None:
    """The next message, or None when the other side closed the socket."""
    head = b""
    fds: list[int] = []
    while len(head) < _HEADER.size:
        data, got, _flags, _addr = socket.recv_fds(sock, _HEADER.size - len(head), 4)
        fds.extend(got)
        if not data:
            for fd in fds:
                os.close(fd)
            return None
        head += data
    body_len, binary_len = _HEADER.unpack(head)
    body = _receive_exactly(sock, body_len)
    binary = _receive_exactly(sock, binary_len)
    if body is None or binary is None:
        for fd in fds:
            os.close(fd)
        return None
    return json.loads(body), binary, fds


def _receive_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        data = sock.recv(min(left, 1 << 20))
        if not data:
            return None
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


# -- one snapshot ----------------------------------------------------------------------------------


@dataclass
class _Job:
    """A snapshot being copied: its pieces in file order as (source address or 0, length, arena offset,
    file end); 0 marks a piece the trainer copied itself."""

    id: int
    pid: int
    protector: WriteProtector
    base: int  # the arena's address in this process
    runs: list[tuple[int, int]]  # the registered (protected) page ranges, sorted
    pieces: list[tuple[int, int, int, int]]
    blocks: dict[int, list[int]] = field(default_factory=dict)  # block number -> pieces overlapping it
    copied: set[int] = field(default_factory=set)
    start_after: float = 0.0  # monotonic time before which the bulk copy waits (tests: faults come first)
    faulted: int = 0  # blocks copied early because the trainer wrote to them
    next_piece: int = 0
    next_block: int = -1  # the block of the current piece to look at next
    reported: int = 0

    def __post_init__(self) -> None:
        for i, (src, length, _off, _end) in enumerate(self.pieces):
            if src and length:
                for k in range(src // BLOCK, (src + length - 1) // BLOCK + 1):
                    self.blocks.setdefault(k, []).append(i)

    @property
    def finished(self) -> bool:
        return self.next_piece >= len(self.pieces)

    @property
    def waiting(self) -> bool:
        return time.monotonic() < self.start_after

    def copy_block(self, k: int) -> None:
        """Copy every piece's bytes in block ``k`` into the arena, then lift the block's protection."""
        lo, hi = k * BLOCK, (k + 1) * BLOCK
        copies = []
        for i in self.blocks.get(k, ()):
            src, length, offset, _end = self.pieces[i]
            a, b = max(src, lo), min(src + length, hi)
            copies.append((self.base + offset + (a - src), a, b - a))
        read_process_memory(self.pid, copies)
        self.copied.add(k)
        starts = [r[0] for r in self.runs]
        at = max(0, bisect.bisect_right(starts, lo) - 1)
        for start, end in self.runs[at:]:
            if start >= hi:
                break
            a, b = max(start, lo), min(end, hi)
            if a < b:
                self.protector.unprotect(a, b - a)

    def serve_faults(self) -> None:
        for address in self.protector.faults():
            k = address // BLOCK
            if k in self.blocks and k not in self.copied:
                self.copy_block(k)
                self.faulted += 1
            else:  # copied (and released) after the fault was queued: just make sure the writer runs
                page = address - address % mmap.PAGESIZE
                self.protector.wake(page, mmap.PAGESIZE)

    def step(self) -> int | None:
        """Copy the next uncopied block in file order; returns the file bytes now ready when a piece ends."""
        if self.next_piece >= len(self.pieces):
            return None
        src, length, _off, end = self.pieces[self.next_piece]
        if src and length:
            last = (src + length - 1) // BLOCK
            k = max(self.next_block, src // BLOCK)
            while k <= last and k in self.copied:
                k += 1
            if k <= last:
                self.copy_block(k)
                self.next_block = k + 1
                return None
        self.next_piece += 1
        self.next_block = -1
        return end

    def close(self) -> None:
        for start, end in self.runs:
            try:
                self.protector.unregister(start, end - start)
            except OSError:
                pass  # closing the descriptor unregisters whatever is left
        self.protector.close()


# -- the process ------------------------------------------------------------------------------------


class Helper:
    """The helper's state: the socket to the trainer, the arenas it mapped, the jobs in progress."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.arenas: dict[str, tuple[mmap.mmap, int]] = {}  # token -> (mapping, address)
        self.jobs: list[_Job] = []

    def run(self) -> None:
        while True:
            busy = [j for j in self.jobs if not j.finished]
            timeout = None if not busy else max(0.0, min(j.start_after for j in busy) - time.monotonic())
            waiting = [self.sock] + [j.protector.fd for j in self.jobs]
            readable, _, _ = select.select(waiting, [], [], timeout)
            if self.sock in readable and not self.handle(receive_message(self.sock)):
                return
            for job in list(self.jobs):
                self.guard(job, job.serve_faults)
            for job in self.jobs:
                if not job.finished and not job.waiting:
                    self.guard(job, lambda job=job: self.advance(job))
                    break

    def guard(self, job: _Job, fn: Any) -> None:
        """Run ``fn``; a failure ends the job (its descriptor closes: every blocked writer goes on)."""
        try:
            fn()
        except OSError as exc:
            self.end(job, error=f"copy-on-write snapshot failed: {exc}")

    def advance(self, job: _Job) -> None:
        ready = job.step()
        if job.finished:
            self.end(job)
        elif ready is not None and ready - job.reported >= REPORT_EVERY:
            job.reported = ready
            send_message(self.sock, {"id": job.id, "ready": ready})

    def end(self, job: _Job, error: str | None = None) -> None:
        job.close()
        if job in self.jobs:
            self.jobs.remove(job)
        send_message(self.sock, {"id": job.id, "error": error} if error else
                     {"id": job.id, "done": True, "faulted": job.faulted})

    def handle(self, received: tuple[dict[str, Any], bytes, list[int]] | None) -> bool:
        """Act on one message from the trainer; False when it is gone or says stop."""
        if received is None:
            for job in self.jobs:  # the trainer is gone: nothing left to protect or copy for
                job.close()
            return False
        message, binary, fds = received
        op = message.get("op")
        if op == "stop":
            return False
        if op == "hello":  # prove we may read the trainer's memory before any snapshot relies on it
            try:
                buf = bytearray(message["length"])
                read_process_memory(message["pid"], [(_address(buf), message["address"], len(buf))])
                send_message(self.sock, {"hello": bytes(buf).hex()})
            except OSError as exc:
                send_message(self.sock, {"hello": None, "error": str(exc)})
        elif op == "forget":
            mapped = self.arenas.pop(message["arena"], None)
            if mapped is not None:
                mapped[0].close()
        elif op == "job":
            self.start_job(message, binary, fds)
        return True

    def start_job(self, message: dict[str, Any], binary: bytes, fds: list[int]) -> None:
        uffd_fd, memfd = fds
        protector = WriteProtector(uffd_fd, message["features"])
        token = message["arena"]
        if token in self.arenas:
            os.close(memfd)
        else:
            mapping = mmap.mmap(memfd, message["capacity"], flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            os.close(memfd)
            self.arenas[token] = (mapping, _address(mapping))
        words = array.array("Q")
        words.frombytes(binary)
        n_runs = message["runs"]
        runs = [(words[2 * i], words[2 * i + 1]) for i in range(n_runs)]
        rest = words[2 * n_runs:]
        pieces = [(rest[i], rest[i + 1], rest[i + 2], rest[i + 3]) for i in range(0, len(rest), 4)]
        job = _Job(id=message["id"], pid=message["pid"], protector=protector, base=self.arenas[token][1],
                   runs=runs, pieces=pieces, start_after=time.monotonic() + message.get("pause", 0.0))
        try:
            for start, end in runs:
                protector.protect(start, end - start)
        except OSError as exc:
            job.close()  # lifts what was protected
            send_message(self.sock, {"id": job.id, "protected": False, "error": f"write-protecting: {exc}"})
            return
        self.jobs.append(job)
        send_message(self.sock, {"id": job.id, "protected": True})


def _address(buffer: Any) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[1]))
    try:
        Helper(sock).run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the trainer is gone
    return 0


if __name__ == "__main__":  # pragma: no cover - run as a process by ucp.cow
    sys.exit(main(sys.argv))
