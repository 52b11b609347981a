"""Opening files for direct I/O, with a logged fallback where O_DIRECT is refused."""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from .errors import AioError

log = logging.getLogger(__name__)

O_DIRECT = getattr(os, "O_DIRECT", 0)
_warned_dirs: set[str] = set()


@dataclass
class OpenFile:
    """A file descriptor plus what the engines need to know about it."""

    fd: int
    path: str
    direct: bool
    writable: bool

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "OpenFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_file(path: str | os.PathLike[str], mode: str, *, direct: bool = True) -> OpenFile:
    """Open ``path`` for ``"r"`` (read) or ``"w"`` (create/truncate) or ``"r+"`` (update).

    With ``direct`` the file is opened with O_DIRECT; if the file system refuses it
    (tmpfs, some FUSE and network mounts answer EINVAL) the file is opened buffered
    and the reason is logged once per directory.
    """
    path = os.fspath(path)
    flags = {"r": os.O_RDONLY, "w": os.O_RDWR | os.O_CREAT | os.O_TRUNC, "r+": os.O_RDWR}[mode]
    flags |= getattr(os, "O_CLOEXEC", 0)
    if direct and O_DIRECT:
        try:
            fd = os.open(path, flags | O_DIRECT, 0o644)
            return OpenFile(fd, path, True, mode != "r")
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise AioError(exc.errno or errno.EIO, path, None, "open") from exc
            parent = os.path.dirname(os.path.abspath(path))
            if parent not in _warned_dirs:
                _warned_dirs.add(parent)
                log.info("O_DIRECT refused under %s (%s); using buffered I/O there", parent, exc.strerror)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise AioError(exc.errno or errno.EIO, path, None, "open") from exc
    return OpenFile(fd, path, False, mode != "r")


def preallocate(f: OpenFile, nbytes: int) -> None:
    """Reserve ``nbytes`` for a new file so that writes neither block on allocation nor hit ENOSPC late."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(f.fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            log.debug("fallocate unsupported for %s: %s", f.path, exc.strerror)
            return
        raise AioError(exc.errno or errno.EIO, f.path, 0, f"preallocating {nbytes} bytes") from exc


def sync_file(f: OpenFile, *, data_only: bool = True) -> None:
    try:
        (os.fdatasync if data_only else os.fsync)(f.fd)
    except OSError as exc:
        raise AioError(exc.errno or errno.EIO, f.path, None, "fsync") from exc


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that entries created or renamed in it are durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate(f: OpenFile, nbytes: int) -> None:
    try:
        os.ftruncate(f.fd, nbytes)
    except OSError as exc:
        raise AioError(exc.errno or errno.EIO, f.path, nbytes, "truncate") from exc
