"""Linux write-protect userfaultfd and cross-process memory reads: what a copy-on-write snapshot needs.

A *write-protect* userfaultfd (``UFFDIO_REGISTER_MODE_WP``) lets one process mark
pages of another's memory read-only at the page-table level: a write to such a page
(by any thread of the owner, or by the kernel on its behalf, e.g. ``read(2)`` into
it) blocks until whoever holds the descriptor copies what it needs and lifts the
protection. :mod:`ucp.saving.cow.snapshot` protects the tensors of a save that way and a helper
process (:mod:`ucp.saving.cow.helper`) copies them out with ``process_vm_readv``; the
trainer never waits for the copy unless it writes a page that has not been copied.

Only x86-64 and arm64 Linux with ``CONFIG_USERFAULTFD`` qualify, and the caller must
be allowed to create a descriptor that also sees kernel-mode faults (root,
``CAP_SYS_PTRACE``, or ``vm.unprivileged_userfaultfd=1``); :func:`unavailable` says
why not otherwise. Container runtimes often block the system call.

Plain ``ioctl`` wrappers: ``fcntl.ioctl`` with packed structs, ctypes only for the two
system calls Python lacks.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import struct
import sys
from typing import Sequence

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# System call numbers (userfaultfd has none in Python's os module).
_NR_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_NR_PROCESS_VM_READV = {"x86_64": 310, "aarch64": 270}

# <linux/userfaultfd.h>: ioctl numbers are _IOWR/_IOR(0xAA, nr, struct); the structs are 64-bit words.
_UFFD_API = 0xAA
_UFFDIO_API = 0xC018AA3F  # struct uffdio_api {api, features, ioctls}
_UFFDIO_REGISTER = 0xC020AA00  # struct uffdio_register {start, len, mode, ioctls}
_UFFDIO_UNREGISTER = 0x8010AA01  # struct uffdio_range {start, len}
_UFFDIO_WAKE = 0x8010AA02  # struct uffdio_range
_UFFDIO_WRITEPROTECT = 0xC018AA06  # struct uffdio_writeprotect {start, len, mode}
_REGISTER_MODE_WP = 2
_WRITEPROTECT_MODE_WP = 1
_FEATURE_PAGEFAULT_FLAG_WP = 1 << 0
_FEATURE_EVENT_REMAP = 1 << 2  # mremap, munmap and madvise(DONTNEED) of watched memory are reported (and
_FEATURE_EVENT_REMOVE = 1 << 3  # wait until the report is read), so memory freed before it was copied is
_FEATURE_EVENT_UNMAP = 1 << 6  # noticed before anything else can be mapped there
_FEATURE_WP_UNPOPULATED = 1 << 13  # protecting never-touched pages too (Linux 6.4)
_EVENT_PAGEFAULT = 0x12
_EVENT_REMAP, _EVENT_REMOVE, _EVENT_UNMAP = 0x14, 0x15, 0x16
MESSAGE_SIZE = 32  # struct uffd_msg: event (u8), padding, then arg.pagefault {flags, address, ...}

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _syscall_number(table: dict[str, int]) -> int | None:
    return table.get(platform.machine()) if sys.platform == "linux" else None


class WriteProtector:
    """A write-protect userfaultfd of *this* process's memory (hand its descriptor to another process).

    Created here because a descriptor always watches its creator's address space;
    every method also works from a process that received the descriptor.
    """

    def __init__(self, fd: int, features: int) -> None:
        self.fd = fd
        self.features = features

    @classmethod
    def create(cls) -> "WriteProtector":
        """A new descriptor (non-blocking, close-on-exec); OSError when the system refuses one."""
        nr = _syscall_number(_NR_USERFAULTFD)
        if nr is None:
            raise OSError(errno.ENOSYS, f"userfaultfd is not supported on {sys.platform}/{platform.machine()}")
        # Not WP_HUGETLBFS_SHMEM: shared memory can be written through other mappings (another process, the
        # file) that our page tables do not cover, so registering it must fail and its tensors be copied.
        events = _FEATURE_EVENT_REMAP | _FEATURE_EVENT_REMOVE | _FEATURE_EVENT_UNMAP
        wanted = _FEATURE_PAGEFAULT_FLAG_WP | _FEATURE_WP_UNPOPULATED | events
        for features in (wanted, _FEATURE_PAGEFAULT_FLAG_WP | events):  # older kernels lack WP_UNPOPULATED
            fd = int(_libc.syscall(ctypes.c_long(nr), ctypes.c_long(os.O_CLOEXEC | os.O_NONBLOCK)))
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"userfaultfd: {os.strerror(err)}")
            try:
                fcntl.ioctl(fd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, features, 0)))
            except OSError as exc:
                os.close(fd)
                if exc.errno == errno.EINVAL and features == wanted:
                    continue
                raise OSError(exc.errno, f"userfaultfd write-protect: {os.strerror(exc.errno or 0)}") from None
            return cls(fd, features)
        raise AssertionError("unreachable")

    @property
    def protects_unpopulated(self) -> bool:
        """Whether pages never written yet are protected too (else their first write is not seen)."""
        return bool(self.features & _FEATURE_WP_UNPOPULATED)

    def register(self, start: int, length: int) -> None:
        """Watch ``[start, start+length)`` (page aligned) for writes to protected pages."""
        fcntl.ioctl(self.fd, _UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", start, length, _REGISTER_MODE_WP, 0)))

    def unregister(self, start: int, length: int) -> None:
        fcntl.ioctl(self.fd, _UFFDIO_UNREGISTER, bytearray(struct.pack("QQ", start, length)))

    def protect(self, start: int, length: int) -> None:
        """Make writes to the (registered) range block until :meth:`unprotect`."""
        fcntl.ioctl(self.fd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", start, length, _WRITEPROTECT_MODE_WP)))

    def unprotect(self, start: int, length: int) -> None:
        """Allow writes again and wake the threads blocked writing there."""
        fcntl.ioctl(self.fd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", start, length, 0)))

    def wake(self, start: int, length: int) -> None:
        fcntl.ioctl(self.fd, _UFFDIO_WAKE, bytearray(struct.pack("QQ", start, length)))

    def events(self, max_messages: int = 64) -> list[tuple[str, int, int]]:
        """The events queued now (empty when none; never blocks): ``("fault", address, 0)`` for a write
        to a protected page, ``("gone", start, end)`` when watched memory was unmapped, moved or
        discarded (munmap, mremap, madvise(DONTNEED)); reading these lets that call return."""
        try:
            data = os.read(self.fd, MESSAGE_SIZE * max_messages)
        except BlockingIOError:
            return []
        out = []
        for at in range(0, len(data) - MESSAGE_SIZE + 1, MESSAGE_SIZE):
            kind = data[at]
            if kind == _EVENT_PAGEFAULT:
                out.append(("fault", struct.unpack_from("Q", data, at + 16)[0], 0))
            elif kind in (_EVENT_REMOVE, _EVENT_UNMAP):
                start, end = struct.unpack_from("QQ", data, at + 8)
                out.append(("gone", start, end))
            elif kind == _EVENT_REMAP:
                start, _to, length = struct.unpack_from("QQQ", data, at + 8)
                out.append(("gone", start, start + length))
        return out

    def faults(self, max_messages: int = 64) -> list[int]:
        """Addresses of the write faults queued now (other events are dropped)."""
        return [a for kind, a, _ in self.events(max_messages) if kind == "fault"]

    def close(self) -> None:
        """Closing the last descriptor unregisters everything and wakes every blocked writer."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def unavailable() -> str | None:
    """Why a write-protect userfaultfd cannot be used here, or None when it can (tried once per process)."""
    global _UNAVAILABLE
    if _UNAVAILABLE is _UNKNOWN:
        try:
            WriteProtector.create().close()
            _UNAVAILABLE = None
            if _syscall_number(_NR_PROCESS_VM_READV) is None:
                _UNAVAILABLE = "process_vm_readv is not supported here"
        except OSError as exc:
            _UNAVAILABLE = str(exc)
    return _UNAVAILABLE  # type: ignore[return-value]


_UNKNOWN = object()
_UNAVAILABLE: object = _UNKNOWN


def read_process_memory(pid: int, copies: Sequence[tuple[int, int, int]]) -> None:
    """Copy ``(local_address, remote_address, length)`` ranges from process ``pid`` into this process.

    Batched into ``process_vm_readv`` calls of up to IOV_MAX ranges; OSError names the first range
    that could not be read (the remote memory is gone, or the process is).
    """
    nr = _syscall_number(_NR_PROCESS_VM_READV)
    if nr is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not supported here")
    for first in range(0, len(copies), IOV_MAX):
        batch = copies[first : first + IOV_MAX]
        local = (_Iovec * len(batch))(*[_Iovec(dst, n) for dst, _, n in batch])
        remote = (_Iovec * len(batch))(*[_Iovec(src, n) for _, src, n in batch])
        want = sum(n for _, _, n in batch)
        got = int(
            _libc.syscall(
                ctypes.c_long(nr),
                ctypes.c_long(pid),
                local,
                ctypes.c_ulong(len(batch)),
                remote,
                ctypes.c_ulong(len(batch)),
                ctypes.c_ulong(0),
            )
        )  # variadic: every word sized
        if got == want:
            continue
        err = ctypes.get_errno() if got < 0 else errno.EFAULT
        done = max(got, 0)
        for at, (_dst, src, n) in enumerate(batch):  # name the range where the copy stopped
            if done < n:
                raise ReadError(err, f"reading {n} bytes at 0x{src:x} of process {pid}: {os.strerror(err)}", first + at)
            done -= n
        raise ReadError(err, f"reading memory of process {pid}: {os.strerror(err)}", first)


class ReadError(OSError):
    """A cross-process read failed; ``index`` is the position in ``copies`` of the range that failed."""

    def __init__(self, err: int, message: str, index: int) -> None:
        super().__init__(err, message)
        self.index = index
