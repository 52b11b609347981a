"""Host staging arenas for asynchronous saves: where a snapshot of the tensors lives until it is on disk.

An arena holds one rank file's complete *image* (safetensors header, then every
piece at its file offset), so the background writer can stream it to disk with
zero-copy O_DIRECT writes and never touches the tensors themselves.

Two kinds, one interface (``capacity``, ``view``, ``tensor``, ``close``):

* :class:`HostArena` — an ``aio.AlignedBuffer`` (anonymous, page aligned,
  pre-faulted, pinned when CUDA is present): the in-process writer thread.
* :class:`SharedArena` — a file in ``/dev/shm`` mapped shared, so a separate
  writer process can map the same pages (``mode="process"``). Also pre-faulted
  and pinned when CUDA is present.

:class:`StagingPool` hands arenas out and takes them back, bounded (the bound is
the saver's ``max_in_flight``), reusing an arena whenever it is large enough so a
training loop that saves the same model every N steps allocates and faults its
staging memory once.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

from aio import AlignedBuffer

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ROUND = 2 << 20  # arena sizes are rounded up to this, so small layout changes still reuse an arena


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, (n + multiple - 1) // multiple * multiple)


class Arena(Protocol):
    """What the snapshot and the writer need from a staging area."""

    capacity: int
    path: str | None  # the shared-memory file (process mode), None for private memory

    def view(self, nbytes: int, offset: int = 0) -> memoryview: ...

    def tensor(self, nbytes: int, offset: int = 0) -> "torch.Tensor": ...

    def close(self) -> None: ...


# -- pinning (cudaHostRegister) for memory we mapped ourselves ------------------------------------


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch missing or a broken CUDA install
        return False


def pin(address: int, nbytes: int) -> bool:
    """Register a host range with CUDA so device-to-host copies into it run asynchronously."""
    try:
        import torch

        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)) == 0
    except Exception as exc:  # pragma: no cover - GPU only
        log.info("could not pin staging memory: %s", exc)
        return False


def unpin(address: int) -> None:
    try:  # pragma: no cover - GPU only
        import torch

        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception as exc:  # pragma: no cover
        log.debug("cudaHostUnregister failed: %s", exc)


def _frombuffer(view: memoryview) -> "torch.Tensor":
    import torch

    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


# -- the two kinds of arena ------------------------------------------------------------------------


class HostArena:
    """Private staging memory of this process (thread mode)."""

    path: str | None = None

    def __init__(self, nbytes: int, *, pin_memory: bool | None = None) -> None:
        self._buf: AlignedBuffer | None = AlignedBuffer(_round_up(nbytes, ROUND), pin=pin_memory)
        self.capacity = self._buf.capacity
        self.pinned = self._buf.pinned

    def _live(self) -> AlignedBuffer:
        if self._buf is None:
            raise ValueError("staging arena used after close()")
        return self._buf

    def view(self, nbytes: int, offset: int = 0) -> memoryview:
        return self._live().view(nbytes, offset)

    def tensor(self, nbytes: int, offset: int = 0) -> "torch.Tensor":
        return self._live().tensor(nbytes, offset)

    def close(self) -> None:
        buf, self._buf = self._buf, None
        if buf is not None and buf.pinned:
            unpin(buf.address)


class SharedArena:
    """Staging memory in a ``/dev/shm`` file, mapped by the trainer (writes) and the writer process (reads).

    The creator owns the file: :meth:`close` unmaps and unlinks it. The writer
    process maps it with :meth:`attach` and unlinks whatever it still has mapped
    when it exits after its trainer died, so no staging file outlives both.
    """

    def __init__(
        self, path: str | None, capacity: int, mapping: mmap.mmap, *, owner: bool, pinned: bool = False
    ) -> None:
        self.path: str | None = path
        self.capacity = capacity
        self._mmap: mmap.mmap | None = mapping
        self._view: memoryview | None = memoryview(mapping)
        self.owner = owner
        self.pinned = pinned
        self.address = _address(mapping)

    @classmethod
    def create(cls, nbytes: int, *, prefix: str, pin_memory: bool | None = None) -> "SharedArena":
        """A new arena in file ``<prefix>-<random>`` (``prefix`` names the directory and the owner)."""
        capacity = _round_up(nbytes, ROUND)
        directory = os.path.dirname(prefix)
        path = f"{prefix}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, capacity)  # allocate now: ENOSPC here, not as a SIGBUS mid-copy
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise OSError(
                        errno.ENOSPC,
                        f"no room for a {capacity}-byte staging arena in {directory} "
                        "(mode='process' stages snapshots in shared memory; pass another staging_dir "
                        "or use mode='thread')",
                        path,
                    ) from None
                raise
            mapping = _map(fd, capacity)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        arena = cls(path, capacity, mapping, owner=True)
        if pin_memory if pin_memory is not None else cuda_available():
            arena.pinned = pin(arena.address, capacity)
        return arena

    @classmethod
    def attach(cls, path: str, capacity: int) -> "SharedArena":
        """Map an arena another process created (the writer process's side)."""
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            return cls(path, capacity, _map(fd, capacity), owner=False)
        finally:
            os.close(fd)

    def view(self, nbytes: int, offset: int = 0) -> memoryview:
        if self._view is None:
            raise ValueError(f"staging arena {self.path} used after close()")
        if offset < 0 or offset + nbytes > self.capacity:
            raise ValueError(f"view [{offset}, {offset + nbytes}) outside arena of {self.capacity} bytes")
        return self._view[offset : offset + nbytes]

    def tensor(self, nbytes: int, offset: int = 0) -> "torch.Tensor":
        return _frombuffer(self.view(nbytes, offset))

    def close(self, *, unlink: bool | None = None) -> None:
        """Unmap; unlink the file too when we created it (or when ``unlink`` says so)."""
        if self._mmap is not None:
            if self.pinned:
                unpin(self.address)
                self.pinned = False
            assert self._view is not None
            self._view.release()
            self._view = None
            try:
                self._mmap.close()
            except BufferError:  # a tensor still views it; the mapping goes when that tensor does
                log.debug("staging arena %s still referenced; unmapped when released", self.path)
            self._mmap = None
        if (self.owner if unlink is None else unlink) and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class MemfdArena(SharedArena):
    """Nameless shared memory (a memfd) for copy-on-write snapshots (:mod:`ucp.saving.cow.snapshot`).

    This process's writer thread reads it; the snapshot helper process maps it through
    the descriptor, passed over a socket. Unlike a ``/dev/shm`` file it needs no room on a
    mount (containers often give ``/dev/shm`` 64 MiB) and vanishes with its last user.
    ``token`` names it to the helper, which keeps it mapped between saves.
    """

    def __init__(self, nbytes: int, *, pin_memory: bool | None = None) -> None:
        capacity = _round_up(nbytes, ROUND)
        fd = os.memfd_create("ucp-staging", os.MFD_CLOEXEC)
        try:
            try:
                os.posix_fallocate(fd, 0, capacity)  # ENOSPC now rather than SIGBUS mid-copy
            except OSError as exc:
                raise OSError(exc.errno, f"no memory for a {capacity}-byte staging arena: {exc.strerror}") from None
            mapping = _map(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        super().__init__(None, capacity, mapping, owner=False)
        self.fd = fd
        self.token = secrets.token_hex(8)
        self.busy: Future | None = None  # the helper's copy into this arena (StagingPool.release waits for it)
        if pin_memory if pin_memory is not None else cuda_available():
            self.pinned = pin(self.address, capacity)

    def close(self, *, unlink: bool | None = None) -> None:
        super().close(unlink=False)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _map(fd: int, capacity: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, capacity, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _address(mapping: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


# -- the pool -------------------------------------------------------------------------------------


class StagingPool:
    """At most ``max_arenas`` arenas out at once; free ones are reused when large enough.

    ``acquire`` blocks while all arenas are in use (that is how an asynchronous
    saver bounds its memory and its saves in flight). ``created`` counts
    allocations, so tests can see that repeated saves reuse their staging.
    """

    def __init__(
        self,
        max_arenas: int,
        *,
        shared: bool = False,
        directory: str = "/dev/shm",
        pin_memory: bool | None = None,
        memfd: bool = False,
    ) -> None:
        if max_arenas < 1:
            raise ValueError("a staging pool needs room for at least one arena")
        self.max_arenas = max_arenas
        self.shared = shared
        self.memfd = memfd  # MemfdArena (copy-on-write snapshots) rather than private memory
        # Shared arenas are files <prefix>-<random>: the owner's pid and this pool, so that a writer process
        # whose trainer died can remove exactly this pool's files.
        self.prefix = os.path.join(directory, f"ucp-staging-{os.getpid()}-{secrets.token_hex(4)}")
        self.pin_memory = pin_memory
        self._free: list[Arena] = []
        self._out = 0
        self._cond = threading.Condition()
        self._closed = False
        self.created = 0
        self.created_bytes = 0  # bytes of the arenas made (a save of StreamedShards makes a compact one)
        self.on_drop: list = []  # callbacks(arena) run before an arena is closed (the writer process unmaps it)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the saver is closed)."""
        return self._closed

    def acquire(self, nbytes: int, timeout: float | None = None) -> Arena:
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self._out < self.max_arenas, timeout):
                raise TimeoutError(f"no staging arena free within {timeout}s ({self.max_arenas} in use)")
            if self._closed:
                raise RuntimeError("the asynchronous saver is closed")
            fits = [a for a in self._free if a.capacity >= nbytes]
            arena = min(fits, key=lambda a: a.capacity) if fits else None
            if arena is not None:
                self._free.remove(arena)
                self._out += 1
                return arena
            # Nothing fits: drop free arenas so the total stays bounded by max_arenas.
            while self._free and len(self._free) + self._out >= self.max_arenas:
                self._drop(self._free.pop(0))
            self._out += 1
        try:
            if self.shared:
                new: Arena = SharedArena.create(nbytes, prefix=self.prefix, pin_memory=self.pin_memory)
            elif self.memfd:
                new = MemfdArena(nbytes, pin_memory=self.pin_memory)
            else:
                new = HostArena(nbytes, pin_memory=self.pin_memory)
        except BaseException:
            with self._cond:
                self._out -= 1
                self._cond.notify()
            raise
        self.created += 1
        self.created_bytes += nbytes
        return new

    def release(self, arena: Arena) -> None:
        """Take ``arena`` back — once its ``busy`` future (a copy still writing into it) is done."""
        busy = getattr(arena, "busy", None)
        if busy is not None and not busy.done():
            busy.add_done_callback(lambda _f: self.release(arena))
            return
        with self._cond:
            self._out -= 1
            if self._closed:
                self._drop(arena)
            else:
                self._free.append(arena)
            self._cond.notify()

    def _drop(self, arena: Arena) -> None:
        for cb in self.on_drop:
            try:
                cb(arena)
            except Exception as exc:  # pragma: no cover - best effort
                log.debug("staging drop callback failed: %s", exc)
        arena.close()

    def close(self) -> None:
        """Free every idle arena now and those in use when they come back."""
        with self._cond:
            self._closed = True
            while self._free:
                self._drop(self._free.pop())
            self._cond.notify_all()
