"""Where checkpoint files live: local directories through ``aio``, anything else through fsspec.

A :class:`Storage` is rooted at the directory (or prefix) that *contains* the
checkpoint, because the commit works on siblings: the temporary directory, the
final name and the old checkpoint being replaced. Paths passed to its methods are
relative to that root and use ``/``.

Local paths get O_DIRECT streaming writes and reads through ``aio``; URLs
(``memory://``, ``file://``, ``s3://`` ...) go through ``fsspec.core.url_to_fs``
with the same file format, and their "rename" is whatever the backend offers
(a copy plus delete on object stores).
"""

from __future__ import annotations

import abc
import ctypes
import errno
import os
import shutil
import threading
from typing import Any, Iterable, Protocol, TypeVar

from aio import AioConfig, AioHandle, as_bytes_view, fsync_dir, shared_handle
from ucp.errors import CheckpointError, CorruptCheckpointError


class ByteWriter(Protocol):
    """A sequential writer of one new file (``aio.FileWriter`` fits)."""

    def write(self, data: Any, *, borrow: bool = False) -> None: ...

    def close(self) -> int: ...

    def abort(self) -> None: ...


_W = TypeVar("_W", bound="ClosingWriter")


class ClosingWriter(abc.ABC):
    """Base of the store's own writers: a ``with`` block closes the writer when it ends normally and aborts
    it (nothing left behind) when it raises; the fsspec and S3 writers share this."""

    @abc.abstractmethod
    def close(self) -> int: ...

    @abc.abstractmethod
    def abort(self) -> None: ...

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Storage(abc.ABC):
    """File operations a checkpoint needs, relative to a root directory or prefix."""

    root: str
    local: bool = False
    """Whether entries are files of this machine's OS (:meth:`local_path` gives their paths)."""
    supports_locks: bool = False
    """Whether ``flock`` on its directories and files works: in-flight markers and liveness locks."""
    config: AioConfig = AioConfig()
    """How writes are sized and paced; only local storage moves its bytes through ``aio``."""
    renames: bool = True
    """Whether a directory can be moved into place (a rename, or a copy that stands in for one). Where it
    cannot (object stores: ``ucp.store.s3``), a save writes its files under the final prefix and commits
    by writing the manifest last (``ucp.store.commit``)."""

    def local_path(self, rel: str) -> str | None:
        """The OS path of ``rel`` where entries are local files; None elsewhere (URLs, object stores)."""
        return None

    def remove_file(self, rel: str) -> None:
        """Delete one file; backends without a single-file delete remove it as a tree (missing is fine)."""
        self.remove_tree(rel)

    def check_contained(self, rel: str) -> None:
        """Refuse a member ``<checkpoint>/<file>`` that resolves outside its checkpoint directory.

        A no-op where entries cannot be symbolic links (URLs, object stores); see
        :meth:`LocalStorage.member_path`.
        """
        return None

    def describe(self, rel: str) -> str:
        """A human-readable location for messages."""
        if not rel:
            return self.root
        return f"{self.root}{rel}" if self.root.endswith("/") else f"{self.root}/{rel}"

    @abc.abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def makedirs(self, rel: str) -> None: ...

    @abc.abstractmethod
    def remove_tree(self, rel: str) -> None: ...

    @abc.abstractmethod
    def listdir(self, rel: str) -> list[str]: ...

    @abc.abstractmethod
    def size(self, rel: str) -> int:
        """Size of a file; FileNotFoundError when it does not exist."""

    @abc.abstractmethod
    def open_writer(self, rel: str, size_hint: int) -> ByteWriter: ...

    @abc.abstractmethod
    def write_small(self, rel: str, data: bytes) -> None:
        """Write a small file (the manifest) durably."""

    @abc.abstractmethod
    def read_small(self, rel: str) -> bytes: ...

    @abc.abstractmethod
    def read_into(self, rel: str, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` from ``offset``; an error when the file is shorter. Safe to call from several threads."""

    def read_ranges(self, rel: str, ranges: Iterable[tuple[int, memoryview]]) -> None:
        for offset, dest in ranges:
            self.read_into(rel, offset, dest)

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None: ...

    def exchange(self, a: str, b: str) -> bool:
        """Atomically swap two entries if the backend can; False when it cannot (nothing changed)."""
        return False

    def sync_dir(self, rel: str) -> None:  # noqa: B027 - a no-op default, not abstract: meaningless on some backends
        """Make a directory's entries durable (no-op where meaningless)."""

    def close(self) -> None:  # noqa: B027 - a no-op default, not abstract: most backends hold nothing
        """Release what the storage holds (nothing by default)."""

    def __enter__(self) -> "Storage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalStorage(Storage):
    """A local directory; data moves through ``aio`` (O_DIRECT, many requests in flight)."""

    local = True
    supports_locks = True

    def __init__(self, root: str, aio_config: AioConfig | None = None) -> None:
        self.root = os.path.abspath(root)
        self.config = aio_config or AioConfig()
        self._io: AioHandle | None = None
        self._io_lock = threading.Lock()

    @property
    def io(self) -> AioHandle:
        """The process-wide I/O handle for this configuration (``aio.shared_handle``).

        Shared so that repeated saves and loads reuse one engine and its faulted-in
        staging pool instead of paying ~0.3 s to build them every time.
        """
        if self._io is None:
            with self._io_lock:
                if self._io is None:
                    self._io = shared_handle(self.config)
        return self._io

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def local_path(self, rel: str) -> str:
        return self.path(rel)

    def remove_file(self, rel: str) -> None:
        """``os.unlink``: a missing file raises FileNotFoundError."""
        os.unlink(self.path(rel))

    def member_path(self, rel: str) -> str:
        """The resolved path of ``rel`` (``<checkpoint>/<file>``), refused when it lies outside ``<checkpoint>``.

        Why: a data file or manifest that is a symlink to ``/etc/...`` or another run's checkpoint
        would make load and verify succeed on bytes that are not the checkpoint's. Links that stay
        inside the checkpoint directory keep working. Raises CorruptCheckpointError naming the file
        and where it points. A ``rel`` of one component (the checkpoint itself) is not checked.
        """
        path = self.path(rel)
        head, sep, _ = rel.partition("/")
        if not sep:
            return path
        target = escapes(self.path(head), path)
        if target is not None:
            raise CorruptCheckpointError(
                f"{self.describe(rel)} resolves to {target}, outside the checkpoint directory "
                f"{os.path.realpath(self.path(head))}; refusing to read it",
                file=rel.split("/", 1)[1],
            )
        return os.path.realpath(path)

    def check_contained(self, rel: str) -> None:
        self.member_path(rel)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def makedirs(self, rel: str) -> None:
        os.makedirs(self.path(rel), exist_ok=True)

    def remove_tree(self, rel: str) -> None:
        remove_path(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        return sorted(os.listdir(self.path(rel)))

    def size(self, rel: str) -> int:
        return os.stat(self.member_path(rel)).st_size

    def open_writer(self, rel: str, size_hint: int) -> ByteWriter:
        return self.io.writer(self.path(rel), size_hint=size_hint)

    def write_small(self, rel: str, data: bytes) -> None:
        fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.config.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read_small(self, rel: str) -> bytes:
        with open(self.member_path(rel), "rb") as f:
            return f.read()

    def read_into(self, rel: str, offset: int, dest: memoryview) -> None:
        self.io.read_into(self.member_path(rel), offset, dest)

    def read_ranges(self, rel: str, ranges: Iterable[tuple[int, memoryview]]) -> None:
        self.io.read_ranges(self.member_path(rel), ranges)

    def rename(self, src: str, dst: str) -> None:
        os.rename(self.path(src), self.path(dst))

    def exchange(self, a: str, b: str) -> bool:
        return rename_exchange(self.path(a), self.path(b))

    def sync_dir(self, rel: str) -> None:
        if self.config.fsync:
            fsync_dir(self.path(rel))

    def close(self) -> None:
        with self._io_lock:
            self._io = None  # the shared handle lives on for the next storage


def escapes(base: str | os.PathLike[str], path: str | os.PathLike[str]) -> str | None:
    """Where ``path`` really points when that is outside directory ``base`` (symlinks resolved), else None.

    The one containment check for files a checkpoint (or a foreign checkpoint being imported)
    names: both sides are resolved with ``os.path.realpath``, so a link inside ``base`` pointing
    elsewhere inside ``base`` passes, and ``base`` itself may be a link.
    """
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    if real == real_base or real.startswith(real_base.rstrip(os.sep) + os.sep):
        return None
    return real


def remove_path(path: str | os.PathLike[str]) -> None:
    """Delete a directory tree, best effort; a symlink is unlinked, never followed.

    A checkpoint (or export) destination that is a symlink is replaced as a link: the commit
    swaps the new directory in under the link's name and then removes the link, so what the link
    pointed to is left untouched. ``shutil.rmtree`` refuses symlinks, hence this helper.
    """
    if os.path.islink(path):
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    shutil.rmtree(path, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def rename_exchange(a: str, b: str) -> bool:
    """Linux ``renameat2(RENAME_EXCHANGE)``: swap two paths atomically. False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


class _FsspecWriter(ClosingWriter):
    def __init__(self, fs: Any, path: str) -> None:
        self._fs, self.path = fs, path
        self._f = fs.open(path, "wb")
        self.size = 0

    def write(self, data: Any, *, borrow: bool = False) -> None:
        view = as_bytes_view(data)  # fsspec copies or writes synchronously: ``borrow`` needs nothing
        self._f.write(view)
        self.size += view.nbytes

    def close(self) -> int:
        self._f.close()
        return self.size

    def abort(self) -> None:
        try:
            self._f.close()
        finally:
            try:
                self._fs.rm(self.path)
            except (FileNotFoundError, OSError):
                pass


MANIFEST = "manifest.json"  # ucp.format.manifest.MANIFEST_NAME (that module sits above this one)


class FsspecStorage(Storage):
    """Any fsspec file system; same format, best-effort atomicity (see docs/format.md)."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self._root = root if root in ("", "/") else root.rstrip("/")
        self.root = url

    def path(self, rel: str) -> str:
        if not rel:
            return self._root
        if self._root in ("", "/"):
            return f"{self._root}{rel}"
        return f"{self._root}/{rel}"

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def makedirs(self, rel: str) -> None:
        self.fs.makedirs(self.path(rel), exist_ok=True)

    def remove_tree(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except (FileNotFoundError, OSError):
            pass

    def listdir(self, rel: str) -> list[str]:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path(rel), detail=False))

    def size(self, rel: str) -> int:
        info = self.fs.info(self.path(rel))
        if info.get("type") == "directory":
            raise FileNotFoundError(errno.ENOENT, "is a directory", self.path(rel))
        return int(info["size"])

    def open_writer(self, rel: str, size_hint: int) -> ByteWriter:
        return _FsspecWriter(self.fs, self.path(rel))

    def write_small(self, rel: str, data: bytes) -> None:
        with self.fs.open(self.path(rel), "wb") as f:
            f.write(data)

    def read_small(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(rel)))

    def read_into(self, rel: str, offset: int, dest: memoryview) -> None:
        n = dest.nbytes
        if n == 0:
            return
        data = self.fs.cat_file(self.path(rel), start=offset, end=offset + n)
        if len(data) != n:
            raise CheckpointError(
                f"{self.describe(rel)}: file ends before byte {offset + n} (got {len(data)} of {n} bytes at offset {offset})"
            )
        dest[:] = data

    def rename(self, src: str, dst: str) -> None:
        """A copy then a delete on most backends, so ordered: a directory's data files are copied
        before its manifest, and its manifest is deleted first, so that a prefix holding a
        ``manifest.json`` never lacks the data files it lists, whenever the move stops."""
        a, b = self.path(src), self.path(dst)
        if not self.fs.isdir(a):
            self.fs.mv(a, b)
            return
        files = sorted(self.fs.find(a), key=lambda f: f == f"{a}/{MANIFEST}")  # the manifest last
        for f in files:
            target = b + f[len(a) :]
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)  # file systems with real directories
            self.fs.copy(f, target)
        if f"{a}/{MANIFEST}" in files:
            self.fs.rm(f"{a}/{MANIFEST}")
        self.fs.rm(a, recursive=True)


def as_aio_config(aio_config: AioConfig | dict[str, Any] | None) -> AioConfig | None:
    """Accept an AioConfig or a DeepSpeed-style ``aio`` dict."""
    if aio_config is None or isinstance(aio_config, AioConfig):
        return aio_config
    return AioConfig.from_deepspeed(aio_config)


_default_url_options: dict[str, Any] | None = None


def set_default_storage_options(options: dict[str, Any] | None) -> None:
    """Options for every URL that :func:`open_storage` opens without its own (None: none). The command
    line's ``--storage-options`` of commands that open URLs deep inside (``reshape``, ``convert``, ``ls``):
    one process, one command, so a process-wide default. Local paths never take them."""
    global _default_url_options
    _default_url_options = options


def open_storage(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None, aio_config: AioConfig | None = None
) -> tuple[Storage, str]:
    """The storage holding checkpoint ``path``, and the checkpoint's name inside it.

    ``s3://`` URLs get :class:`ucp.store.s3.S3Storage` (options: :class:`ucp.store.s3.S3Options`), other
    URLs fsspec, local paths :class:`LocalStorage`."""
    text = os.fspath(path)
    if storage_options is None and "://" in text:
        storage_options = _default_url_options
    if text.startswith("s3://"):
        from ucp.store.s3 import open_s3

        return open_s3(text, storage_options)
    if "://" not in text and not storage_options:
        full = os.path.abspath(text)
        parent, name = os.path.split(full.rstrip(os.sep) or os.sep)
        if not name:
            raise CheckpointError(f"checkpoint path {text!r} has no final component")
        return LocalStorage(parent, aio_config), name
    import fsspec.core

    fs, inner = fsspec.core.url_to_fs(text, **(storage_options or {}))
    inner = inner.rstrip("/")
    parent, _, name = inner.rpartition("/")
    if not name:
        raise CheckpointError(f"checkpoint path {text!r} has no final component")
    if not parent and inner.startswith("/"):
        parent = "/"
    url = text.rstrip("/")
    url_parent = url[: len(url) - len(name)]  # keeps its slash: "memory://", "file:///", "s3://bucket/run/"
    return FsspecStorage(fs, parent, url_parent), name
