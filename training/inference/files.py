"""Where weight files are read from: local paths, or ``s3://`` URLs of an object store.

A :class:`~training.inference.sources.WeightSource` names its files by path (local) or by URL
(``s3://bucket/key``); its :class:`Files` answers what opening the weights needs (does a file
exist, its size, a header's bytes, a directory's listing) and gives the executor the
:class:`RangeReader` that fills the ring's buffers:

* local files: ``aio``'s :class:`~aio.AioHandle` (O_DIRECT reads, many in flight), as always;
* ``s3://`` (:class:`ObjectFiles`): ``ucp.store.s3``'s parallel ranged GETs, copied straight into the
  same budgeted ring buffers (the layout's page alignment is harmless there). Endpoint and
  credentials come from ``storage_options`` (:class:`ucp.store.s3.S3Options`) or the AWS variables.
  Each ranged GET's body is held until it is copied, so a read has up to ``concurrency * read_size``
  bytes in flight beyond the budget (``--storage-options '{"concurrency": 4, "read_size": "4MiB"}'``
  bounds it).

Errors name the file or URL: a missing object is FileNotFoundError, a missing bucket, refused
credentials or an exhausted retry budget :class:`ucp.errors.StorageError`.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Protocol

from aio import AioConfig, AioHandle


class RangeReader(Protocol):
    """What the executor's ring reads through: ``read_ranges(file, [(offset, dest), ...])`` fills every
    ``dest`` from ``offset`` of ``file`` (all in flight together)."""

    @property
    def engine_name(self) -> str: ...

    def read_ranges(self, file: str, ranges: Iterable[tuple[int, Any]]) -> None: ...

    def close(self) -> None: ...


class Files(Protocol):
    """File access for opening weights; paths are what the source's runs name."""

    remote: bool

    def isfile(self, path: str) -> bool: ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]: ...

    def size(self, path: str) -> int: ...

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """``length`` bytes from ``offset`` (None: to the end); fewer only where the file ends first."""
        ...

    def reader(self, config: AioConfig) -> RangeReader: ...


class LocalFiles:
    """Files of this machine; the executor reads them through ``aio``."""

    remote = False

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read() if length is None else fh.read(length)

    def reader(self, config: AioConfig) -> RangeReader:
        return AioHandle(config)


LOCAL = LocalFiles()


class ObjectFiles:
    """Objects of an S3-compatible store addressed by URL, one :class:`~ucp.store.s3.S3Storage` per bucket.

    Sizes are looked up once (a weights directory does not change while it is read); the executor's
    reads go through :meth:`read_ranges` (it is its own :class:`RangeReader`)."""

    remote = True
    engine_name = "s3"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        from ucp.store.s3 import parse_options

        self.options = parse_options(url, storage_options)
        self._stores: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}

    def _at(self, url: str) -> tuple[Any, str]:
        """(the bucket's storage, the object's key) of ``url``."""
        from ucp.store.s3 import S3Storage, is_s3_url, split_url

        if not is_s3_url(url):
            raise ValueError(f"{url}: weights on an object store are named by s3:// URLs")
        bucket, key = split_url(url)
        if bucket not in self._stores:
            self._stores[bucket] = S3Storage(bucket, "", self.options)
        return self._stores[bucket], key

    def isfile(self, path: str) -> bool:
        try:
            self.size(path)
        except FileNotFoundError:
            return False
        return True

    def exists(self, path: str) -> bool:
        storage, key = self._at(path)
        return bool(storage.exists(key))

    def listdir(self, path: str) -> list[str]:
        storage, key = self._at(path)
        names: list[str] = storage.listdir(key)
        return names

    def size(self, path: str) -> int:
        if path not in self._sizes:
            storage, key = self._at(path)
            self._sizes[path] = int(storage.size(key))
        return self._sizes[path]

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        storage, key = self._at(path)
        if offset == 0 and length is None:
            data: bytes = storage.read_small(key)
            return data
        end = self.size(path) if length is None else min(offset + length, self.size(path))
        buf = bytearray(max(0, end - offset))
        if buf:
            storage.read_ranges(key, [(offset, memoryview(buf))])
        return bytes(buf)

    def read_ranges(self, file: str, ranges: Iterable[tuple[int, Any]]) -> None:
        from aio import as_bytes_view

        storage, key = self._at(file)
        storage.read_ranges(key, [(off, as_bytes_view(dest)) for off, dest in ranges])

    def reader(self, config: AioConfig) -> RangeReader:
        return self

    def close(self) -> None:
        for storage in self._stores.values():
            storage.close()


def files_for(path: str, storage_options: dict[str, Any] | None = None) -> Files:
    """:class:`ObjectFiles` for an ``s3://`` URL, :data:`LOCAL` for a path; ValueError for other URLs, and
    for storage options given with a local path."""
    if "://" in path:
        if not path.startswith("s3://"):
            raise ValueError(f"{path}: weights are read from local paths or s3:// URLs, not {path.split('://')[0]}://")
        return ObjectFiles(path, storage_options)
    if storage_options:
        raise ValueError(f"{path}: storage options are for s3:// URLs, not a local path")
    return LOCAL
