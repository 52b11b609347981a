"""The copy-on-write snapshot helper: a small process that copies a trainer's tensors out of its memory.

Started by :class:`ucp.saving.cow.snapshot.CowSnapshots` (``python -m ucp.saving.cow.helper FD``) and fed
through the Unix socket ``FD``. For each snapshot job it receives a write-protect
userfaultfd of the trainer's memory (:mod:`ucp.saving.cow.userfaultfd`), the staging arena (a
memfd), and the pieces to copy. It then:

1. write-protects the job's registered ranges and acknowledges (``save`` returns now);
2. copies the pieces into the arena in file order, 2 MiB of trainer memory at a time
   (``process_vm_readv``), lifting the protection of each block once it is copied and
   reporting how much of the file image is ready (the writer thread follows), and takes each
   piece's CRC-32C from the arena right after copying a block (while it is in cache; the writer
   then does not read the bytes again to checksum them), sending them with "done";
3. between blocks, serves the trainer's write faults: a block written before its turn
   is copied first, then released.

A block is copied exactly once, while still protected, so the arena holds every byte
as it was when ``save`` was called. The helper is a separate process so that it never
needs the trainer's GIL: a trainer thread blocked on a protected page holding the GIL
cannot stall it. If it dies, its descriptors close and the kernel releases every
blocked writer (that snapshot fails; the trainer is never left hanging).

Standard library and the crc32c package only (no torch): it starts in a fraction of a second.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import errno
import json
import mmap
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

import crc32c

from ucp.saving.cow.userfaultfd import ReadError, WriteProtector, read_process_memory

BLOCK = 2 << 20  # trainer memory is copied and released in aligned blocks of this size
REPORT_EVERY = 32 << 20  # bytes of file image between progress messages
_HEADER = struct.Struct("<II")  # JSON length, binary length


# -- framing (shared with the trainer side) ---------------------------------------------------------


def send_message(
    sock: socket.socket, message: dict[str, Any], binary: bytes = b"", fds: list[int] | None = None
) -> None:
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

_COPYING, _COPIED, _FAILED = 1, 2, 3  # block states (absent: not copied yet)


class _Job:
    """A snapshot being copied. Its pieces in file order are (source address or 0, length, arena offset,
    file end); 0 marks a piece the trainer copied itself.

    Blocks are claimed (under ``lock``) by one copier each — a copy thread in file order, or the
    fault server for a block the trainer wrote to first — so each is read exactly once, while still
    protected, and released right after.
    """

    def __init__(
        self,
        id: int,
        pid: int,
        protector: WriteProtector,
        base: int,
        runs: list[tuple[int, int]],
        pieces: list[tuple[int, int, int, int]],
        start_after: float = 0.0,
    ) -> None:
        self.id, self.pid, self.protector, self.base = id, pid, protector, base
        self.runs = runs  # the registered (protected) page ranges, sorted
        self.run_starts = [r[0] for r in runs]
        self.pieces = pieces
        self.start_after = start_after  # monotonic time before which the copy threads wait (tests: faults first)
        self.lock = threading.Lock()
        self.blocks: dict[int, list[int]] = {}  # block number -> pieces overlapping it
        self.order: list[int] = []  # every block once, in file order of the pieces
        self.remaining = [0] * len(pieces)  # per piece: its blocks not copied yet
        for i, (src, length, _off, _end) in enumerate(pieces):
            if src and length:
                for k in range(src // BLOCK, (src + length - 1) // BLOCK + 1):
                    if k not in self.blocks:
                        self.blocks[k] = []
                        self.order.append(k)
                    self.blocks[k].append(i)
                    self.remaining[i] += 1
        self.state: dict[int, int] = {}
        self.next = 0  # index into order of the next block a copy thread may claim
        self.left = len(self.order)  # blocks not copied yet
        self.ready_piece = 0  # pieces before this one are complete in the arena
        self.reported = 0
        self.faulted = 0  # blocks copied early because the trainer wrote to them
        self.error: str | None = None
        self.error_piece: int | None = None  # the piece whose memory could not be read
        self.gone_ranges: list[tuple[int, int]] = []  # memory the trainer unmapped or discarded meanwhile
        # CRC-32C of the pieces we copy, extended in piece order as blocks land (under crc_lock): bytes
        # checksummed so far, the running CRC, and copied spans (start -> length) waiting for their turn.
        self.crc_lock = threading.Lock()
        self.crc_pos = {i: 0 for i, p in enumerate(pieces) if p[0] and p[1]}
        self.crc = dict.fromkeys(self.crc_pos, 0)
        self.crc_waiting: dict[int, dict[int, int]] = {i: {} for i in self.crc_pos}

    @property
    def finished(self) -> bool:
        return self.left == 0 or self.error is not None

    def claim_next(self) -> int | None:
        """The next block in file order nobody copies yet, now claimed; None when there is none."""
        with self.lock:
            if self.error is not None or time.monotonic() < self.start_after:
                return None
            while self.next < len(self.order):
                k = self.order[self.next]
                self.next += 1
                if k not in self.state:
                    self.state[k] = _COPYING
                    return k
            return None

    def copy(self, k: int) -> None:
        """Copy every piece's bytes in (claimed) block ``k`` into the arena, then lift its protection."""
        lo, hi = k * BLOCK, (k + 1) * BLOCK
        copies = []
        for i in self.blocks[k]:
            src, length, offset, _end = self.pieces[i]
            a, b = max(src, lo), min(src + length, hi)
            copies.append((self.base + offset + (a - src), a, b - a))
        try:
            try:
                read_process_memory(self.pid, copies)
            except ReadError as exc:
                with self.lock:
                    if self.error is None:
                        self.error_piece = self.blocks[k][exc.index]  # the trainer names its tensor
                raise
            at = max(0, bisect.bisect_right(self.run_starts, lo) - 1)
            for start, end in self.runs[at:]:
                if start >= hi:
                    break
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    self.protector.unprotect(a, b - a)
        except OSError as exc:
            with self.lock:
                if self.error is None:
                    gone = exc.errno in (errno.EFAULT, errno.ENOENT, errno.ENOMEM)  # unmapped or unregistered
                    self.error = (
                        f"its memory was freed or moved before the copy-on-write snapshot copied it ({exc})"
                        if gone
                        else f"copy-on-write snapshot failed: {exc}"
                    )
                    if self.error_piece is None:
                        self.error_piece = self.blocks[k][0]
                self.state[k] = _FAILED
            return
        for i, (_dst, a, n) in zip(self.blocks[k], copies):
            self.checksum(i, a - self.pieces[i][0], n)
        with self.lock:
            self.state[k] = _COPIED
            self.left -= 1
            for i in self.blocks[k]:
                self.remaining[i] -= 1
            for start, end in self.gone_ranges:  # freed while we read it: what we read may be someone else's
                if start < hi and lo < end:
                    self._lost(k, start, end)

    def checksum(self, i: int, start: int, n: int) -> None:
        """Piece ``i``'s bytes ``[start, start + n)`` are in the arena: extend its CRC over every span now in order."""
        offset = self.pieces[i][2]
        with self.crc_lock:
            waiting = self.crc_waiting[i]
            waiting[start] = n
            pos, crc = self.crc_pos[i], self.crc[i]
            while pos in waiting:
                m = waiting.pop(pos)
                crc = crc32c.crc32c(
                    memoryview((ctypes.c_char * m).from_address(self.base + offset + pos)).cast("B"), crc
                )
                pos += m
            self.crc_pos[i], self.crc[i] = pos, crc

    def crcs(self) -> dict[str, int]:
        """Piece index (as text) -> CRC-32C, for every piece we copied whole."""
        with self.crc_lock:
            return {str(i): self.crc[i] for i, pos in self.crc_pos.items() if pos == self.pieces[i][1]}

    def serve_fault(self, address: int) -> None:
        """The trainer wrote to ``address``: copy its block now unless someone has or is doing so."""
        k = address // BLOCK
        with self.lock:
            mine = k in self.blocks and k not in self.state
            if mine:
                self.state[k] = _COPYING
                self.faulted += 1
            elif self.state.get(k) == _COPYING:
                return  # its copier lifts the protection, which wakes the writer
        if mine:
            self.copy(k)
        else:  # copied and released after the fault was queued: make sure the writer runs
            page = address - address % mmap.PAGESIZE
            self.protector.wake(page, mmap.PAGESIZE)

    def gone(self, start: int, end: int) -> None:
        """The trainer unmapped or discarded ``[start, end)``: a block there not copied yet is lost."""
        with self.lock:
            self.gone_ranges.append((start, end))
            for k in range(start // BLOCK, (end - 1) // BLOCK + 1):
                if k in self.blocks and self.state.get(k) != _COPIED:
                    self._lost(k, start, end)

    def _lost(self, k: int, start: int, end: int) -> None:
        """Fail the job if a piece's bytes in block ``k`` overlap ``[start, end)`` (under ``lock``)."""
        lo, hi = max(k * BLOCK, start), min((k + 1) * BLOCK, end)
        for i in self.blocks[k]:
            src, length = self.pieces[i][0], self.pieces[i][1]
            if src < hi and lo < src + length and self.error is None:
                self.error = "its memory was freed or moved before the copy-on-write snapshot copied it"
                self.error_piece = i

    def ready(self) -> int:
        """Bytes of the file image complete from its start (the writer may write them)."""
        with self.lock:
            while self.ready_piece < len(self.pieces) and self.remaining[self.ready_piece] == 0:
                self.ready_piece += 1
            return self.pieces[self.ready_piece - 1][3] if self.ready_piece else 0

    def close(self) -> None:
        for start, end in self.runs:
            try:
                self.protector.unregister(start, end - start)
            except OSError:
                pass  # closing the descriptor unregisters whatever is left
        self.protector.close()


# -- the process ------------------------------------------------------------------------------------


class Helper:
    """The helper's state: the socket to the trainer, the arenas it mapped, the jobs in progress.

    The main thread reads the trainer's messages and serves write faults, and alone opens and closes
    descriptors. ``threads`` copy threads copy blocks in file order (``process_vm_readv`` releases
    the GIL, so they run in parallel) and poke the main thread through a pipe when a job advanced.
    """

    def __init__(self, sock: socket.socket, threads: int = 2) -> None:
        self.sock = sock
        self.arenas: dict[str, tuple[mmap.mmap, int]] = {}  # token -> (mapping, address)
        self.jobs: list[_Job] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.send_lock = threading.Lock()
        self.poke_r, self.poke_w = os.pipe()
        os.set_blocking(self.poke_w, False)
        self.copiers = [threading.Thread(target=self.copier, daemon=True) for _ in range(threads)]

    def run(self) -> None:
        for t in self.copiers:
            t.start()
        try:
            while True:
                with self.cond:
                    jobs = list(self.jobs)
                waiting: list[socket.socket | int] = [self.sock, self.poke_r, *(j.protector.fd for j in jobs)]
                readable, _, _ = select.select(waiting, [], [])
                if self.sock in readable and not self.handle(receive_message(self.sock)):
                    return
                if self.poke_r in readable:
                    os.read(self.poke_r, 4096)
                for job in jobs:
                    for kind, a, b in job.protector.events():
                        if kind == "fault":
                            job.serve_fault(a)
                        else:
                            job.gone(a, b)
                    self.report(job)
        finally:
            with self.cond:
                self.stopping = True
                self.cond.notify_all()

    def copier(self) -> None:
        """A copy thread: claim the oldest job's next block, copy it, tell the main thread."""
        while True:
            with self.cond:
                claimed = self.claim()
                while claimed is None:
                    if self.stopping:
                        return
                    now = time.monotonic()
                    pauses = [j.start_after - now for j in self.jobs if j.start_after > now]
                    self.cond.wait(min(pauses) if pauses else None)  # new jobs notify
                    claimed = self.claim()
            job, k = claimed
            job.copy(k)
            if job.finished or job.ready() - job.reported >= REPORT_EVERY:
                try:
                    os.write(self.poke_w, b"!")
                except BlockingIOError:
                    pass  # the pipe is full of pokes already

    def claim(self) -> tuple[_Job, int] | None:
        """A block to copy, from the oldest job that has one (called holding ``cond``)."""
        for job in self.jobs:
            k = job.claim_next()
            if k is not None:
                return job, k
        return None

    def report(self, job: _Job) -> None:
        """Tell the trainer how far ``job`` got; end it when it is complete or failed."""
        if job.finished:
            with job.lock:
                copying = any(v == _COPYING for v in job.state.values())
            if copying:
                return  # a copier still reads with the descriptor (only after an error)
            with self.cond:
                if job not in self.jobs:
                    return
                self.jobs.remove(job)
            job.close()
            self.send(
                {"id": job.id, "error": job.error, "piece": job.error_piece}
                if job.error
                else {"id": job.id, "done": True, "faulted": job.faulted, "crcs": job.crcs()}
            )
            return
        ready = job.ready()
        if ready - job.reported >= REPORT_EVERY:
            job.reported = ready
            self.send({"id": job.id, "ready": ready})

    def send(self, message: dict[str, Any]) -> None:
        with self.send_lock:
            send_message(self.sock, message)

    def handle(self, received: tuple[dict[str, Any], bytes, list[int]] | None) -> bool:
        """Act on one message from the trainer; False when it is gone or says stop."""
        if received is None:
            with self.cond:
                jobs, self.jobs = self.jobs, []
                self.stopping = True
                self.cond.notify_all()
            for job in jobs:  # the trainer is gone: nothing left to protect or copy for
                with job.lock:
                    job.error = "the trainer is gone"
            for t in self.copiers:
                t.join()
            for job in jobs:
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
                self.send({"hello": bytes(buf).hex()})
            except OSError as exc:
                self.send({"hello": None, "error": str(exc)})
        elif op == "forget":
            mapped = self.arenas.pop(message["arena"], None)
            if mapped is not None:
                mapped[0].close()
        elif op == "map":  # an arena prepared ahead of the first save
            self.map_arena(message["arena"], message["capacity"], fds[0])
        elif op == "job":
            self.start_job(message, binary, fds)
        return True

    def map_arena(self, token: str, capacity: int, memfd: int) -> int:
        """The address of arena ``token`` here, mapping it (through ``memfd``, which is closed) the first time."""
        if token not in self.arenas:
            mapping = mmap.mmap(memfd, capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            self.arenas[token] = (mapping, _address(mapping))
        os.close(memfd)
        return self.arenas[token][1]

    def start_job(self, message: dict[str, Any], binary: bytes, fds: list[int]) -> None:
        uffd_fd, memfd = fds
        protector = WriteProtector(uffd_fd, message["features"])
        base = self.map_arena(message["arena"], message["capacity"], memfd)
        words = array.array("Q")
        words.frombytes(binary)
        n_runs = message["runs"]
        runs = [(words[2 * i], words[2 * i + 1]) for i in range(n_runs)]
        rest = words[2 * n_runs :]
        pieces = [(rest[i], rest[i + 1], rest[i + 2], rest[i + 3]) for i in range(0, len(rest), 4)]
        job = _Job(
            message["id"],
            message["pid"],
            protector,
            base,
            runs,
            pieces,
            start_after=time.monotonic() + message.get("pause", 0.0),
        )
        try:
            for start, end in runs:
                protector.protect(start, end - start)
        except OSError as exc:
            job.close()  # lifts what was protected
            self.send({"id": job.id, "protected": False, "error": f"write-protecting: {exc}"})
            return
        with self.cond:
            self.jobs.append(job)
            self.cond.notify_all()
        self.send({"id": job.id, "protected": True})
        self.report(job)  # a job with nothing to copy is done at once


def _address(buffer: Any) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; we end when it closes the socket
    sock = socket.socket(fileno=int(argv[1]))
    threads = int(argv[2]) if len(argv) > 2 else 2
    try:
        Helper(sock, threads).run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the trainer is gone
    return 0


if __name__ == "__main__":  # pragma: no cover - run as a process by ucp.saving.cow.snapshot
    sys.exit(main(sys.argv))
