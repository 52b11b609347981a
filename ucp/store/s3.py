"""S3-compatible object stores (AWS S3, MinIO, GCS's S3 API) as a :class:`~ucp.store.storage.Storage`.

Built on ``obstore`` (Rust's ``object_store``): on the loopback benchmark server it fetched ranged
GETs ~4x faster than s3fs/aiobotocore and uploaded multipart parts as fast or faster, with the
client spending far less CPU in Python (docs/object-stores.md has the figures). Its semantics:

* **No rename.** ``renames = False``: a save writes its data files straight under the final
  prefix and commits by writing ``manifest.json`` last (a single PUT: atomic on S3). Readers only
  ever open ``<prefix>/manifest.json``, so a prefix without one is never a checkpoint.
  ``ucp.store.commit`` does this for any storage whose ``renames`` is False; nothing else in a
  save or load knows about object stores.
* **Uploads** of data files are multipart, fed from the writer's own buffers (borrowed views are
  not copied on our side), ``part_size`` bytes a part and ``concurrency`` parts in flight, so the
  memory an upload holds is bounded by about ``concurrency * part_size``. Every request is
  retried with exponential backoff and jitter on 5xx, throttling (503 SlowDown) and dropped
  connections (``max_retries``, ``retry_timeout``); a failed or aborted upload aborts its
  multipart upload, so no parts are left behind, and the error names the object's URL.
* **Reads** are parallel ranged GETs (``concurrency`` at a time, ``part_size`` each) copied
  straight into the caller's memory (the target tensors for ``load(into=)``): only the ranges
  asked for are fetched.

Endpoint, region and credentials come from the usual AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``) unless ``storage_options`` (:class:`S3Options`) says otherwise.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from datetime import timedelta
from typing import Any, Iterable, Iterator

from pydantic import BaseModel, ConfigDict, field_validator

from aio import as_bytes_view
from aio.sizes import parse_size
from ucp.errors import CheckpointError, StorageError
from ucp.store.storage import MANIFEST, ByteWriter, ClosingWriter, Storage

SCHEMES = ("s3://",)
GAP = 64 << 10  # bytes between two wanted ranges that one request reads through rather than splitting


class S3Options(BaseModel):
    """``storage_options`` of an ``s3://`` URL (``--storage-options`` on the command line).

    Unset fields come from the AWS environment variables, then from the defaults below.
    Sizes take ``aio.sizes.parse_size`` strings (``"16MiB"``).
    """

    model_config = ConfigDict(extra="forbid")
    endpoint_url: str | None = None
    """e.g. ``http://127.0.0.1:9000`` (MinIO), ``https://storage.googleapis.com``; default ``AWS_ENDPOINT_URL``."""
    region: str | None = None
    key: str | None = None
    """Access key id; default ``AWS_ACCESS_KEY_ID``."""
    secret: str | None = None
    token: str | None = None
    allow_http: bool | None = None
    """Permit a plain-HTTP endpoint; default: when the endpoint URL starts with ``http://``."""
    virtual_hosted_style: bool = False
    """Address buckets as ``bucket.host`` rather than ``host/bucket`` (path style works everywhere)."""
    unsigned_payload: bool | None = None
    """Sign requests without a SHA-256 of their body (``UNSIGNED-PAYLOAD``): one hash pass less over every
    byte uploaded (the data files carry CRC-32Cs that every load checks). Default: over ``https`` only, as
    AWS's own SDKs do (TLS protects the bytes in transit); plain ``http`` endpoints get signed payloads."""
    part_size: int = 16 << 20
    """Bytes per multipart part (S3 allows 5 MiB to 5 GiB per part)."""
    read_size: int | None = None
    """Most bytes one ranged GET fetches (default: ``part_size``)."""
    concurrency: int = 16
    """Parts uploaded, and ranges fetched, at once per file."""
    max_retries: int = 8
    """Retries of one request on 5xx, throttling and dropped connections (0: none)."""
    backoff_initial: float = 0.05
    backoff_max: float = 5.0
    retry_timeout: float = 120.0
    """Seconds after a request's first attempt past which it is not retried."""
    timeout: float = 300.0
    """Seconds one request may take."""
    connect_timeout: float = 10.0

    @field_validator("part_size", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v, what="part_size", minimum=5 << 20)

    @field_validator("read_size", mode="before")
    @classmethod
    def _read_size(cls, v: Any) -> int | None:
        return None if v is None else parse_size(v, what="read_size", minimum=64 << 10)

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("concurrency must be >= 1")
        return v


def is_s3_url(text: str) -> bool:
    return text.startswith(SCHEMES)


def _client_options(opts: S3Options, endpoint: str | None) -> dict[str, Any]:
    allow_http = opts.allow_http if opts.allow_http is not None else bool(endpoint and endpoint.startswith("http://"))
    return {
        "allow_http": allow_http,
        "timeout": timedelta(seconds=opts.timeout),
        "connect_timeout": timedelta(seconds=opts.connect_timeout),
        "pool_max_idle_per_host": str(max(opts.concurrency, 10)),
    }


def make_store(bucket: str, opts: S3Options) -> Any:
    """An ``obstore`` S3Store for ``bucket`` from ``opts`` and the AWS environment variables."""
    try:
        from obstore.store import S3Store
    except ImportError:
        raise StorageError(
            f"s3://{bucket}: s3:// URLs need obstore, which is not installed (pip install 'ucp[s3]')"
        ) from None

    endpoint = opts.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config: dict[str, Any] = {"virtual_hosted_style_request": opts.virtual_hosted_style}
    if endpoint:
        config["endpoint"] = endpoint
    unsigned = opts.unsigned_payload
    if unsigned is None:  # AWS's endpoints (no endpoint set) are https
        unsigned = not endpoint or endpoint.startswith("https://")
    config["unsigned_payload"] = unsigned
    region = opts.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        config["region"] = region
    if opts.key is not None:
        config["access_key_id"] = opts.key
    if opts.secret is not None:
        config["secret_access_key"] = opts.secret
    if opts.token is not None:
        config["session_token"] = opts.token
    retry = {
        "max_retries": opts.max_retries,
        "retry_timeout": timedelta(seconds=opts.retry_timeout),
        "backoff": {
            "init_backoff": timedelta(seconds=opts.backoff_initial),
            "max_backoff": timedelta(seconds=opts.backoff_max),
            "base": 2,
        },
    }
    return S3Store(
        bucket,
        config=config,  # type: ignore[arg-type]  # built key by key: obstore's TypedDicts want literals
        client_options=_client_options(opts, endpoint),  # type: ignore[arg-type]
        retry_config=retry,  # type: ignore[arg-type]
    )


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``); StorageError for a URL without a bucket."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{url!r} names no bucket (expected s3://BUCKET/PREFIX)")
    return bucket, key.strip("/")


class S3Storage(Storage):
    """A prefix of an S3 bucket (see the module docstring for the semantics)."""

    renames = False

    def __init__(self, bucket: str, prefix: str, options: S3Options | None = None, *, store: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options = options or S3Options()
        self.store = store if store is not None else make_store(bucket, self.options)
        self.root = f"s3://{bucket}/{self.prefix}/" if self.prefix else f"s3://{bucket}/"

    # -- naming and errors ------------------------------------------------------------------------

    def key(self, rel: str) -> str:
        rel = rel.strip("/")
        if not self.prefix:
            return rel
        return f"{self.prefix}/{rel}" if rel else self.prefix

    def url(self, rel: str) -> str:
        return f"s3://{self.bucket}/{self.key(rel)}"

    def describe(self, rel: str) -> str:
        return self.url(rel)

    def _error(self, exc: BaseException, rel: str, what: str) -> BaseException:
        """The error to raise for a failed request on ``rel``: FileNotFoundError for a missing object (so
        callers tell "absent" from "broken"), StorageError naming the URL for everything else."""
        text = str(exc)
        url = self.url(rel)
        if "NoSuchBucket" in text:
            return StorageError(f"{what} {url}: bucket {self.bucket!r} does not exist")
        if isinstance(exc, FileNotFoundError):
            return FileNotFoundError(errno.ENOENT, f"{what} {url}: no such object", url)
        name = type(exc).__name__
        if "PermissionDenied" in name or "Unauthenticated" in name or "403" in text:
            return StorageError(f"{what} {url}: access denied (check the credentials and the endpoint): {_short(text)}")
        return StorageError(f"{what} {url} failed: {name}: {_short(text)}")

    def _call(self, rel: str, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (StorageError, CheckpointError):
            raise
        except Exception as exc:
            raise self._error(exc, rel, what) from exc

    # -- listing ----------------------------------------------------------------------------------

    def _list(self, rel: str) -> tuple[list[str], list[dict[str, Any]]]:
        """(sub-prefix names, objects) directly under ``rel``."""
        import obstore

        prefix = self.key(rel)
        result = self._call(rel, "listing", obstore.list_with_delimiter, self.store, prefix + "/" if prefix else None)
        dirs = [p.rstrip("/").rsplit("/", 1)[-1] for p in result["common_prefixes"]]
        return dirs, list(result["objects"])

    def list_objects(self, rel: str) -> list[dict[str, Any]]:
        """Every object under ``rel`` (recursively): ``path`` (its key), ``rel`` (its path relative to this
        storage's root) and ``size``."""
        import obstore

        prefix = self.key(rel)
        cut = len(self.prefix) + 1 if self.prefix else 0
        out: list[dict[str, Any]] = []
        try:
            for chunk in obstore.list(self.store, prefix + "/" if prefix else None):
                out.extend({**o, "rel": o["path"][cut:]} for o in chunk)
        except Exception as exc:
            raise self._error(exc, rel, "listing") from exc
        return out

    def exists(self, rel: str) -> bool:
        import obstore

        try:
            obstore.head(self.store, self.key(rel))
            return True
        except FileNotFoundError as exc:
            if "NoSuchBucket" in str(exc):
                raise self._error(exc, rel, "looking up") from exc
        except Exception as exc:
            raise self._error(exc, rel, "looking up") from exc
        dirs, objects = self._list(rel)
        return bool(dirs or objects)

    def listdir(self, rel: str) -> list[str]:
        dirs, objects = self._list(rel)
        names = sorted(set(dirs) | {o["path"].rsplit("/", 1)[-1] for o in objects})
        if not names:
            raise FileNotFoundError(errno.ENOENT, f"no objects under {self.url(rel)}/", self.url(rel))
        return names

    def makedirs(self, rel: str) -> None:
        """Nothing to do: prefixes exist as long as an object is under them."""

    def size(self, rel: str) -> int:
        import obstore

        return int(self._call(rel, "looking up", obstore.head, self.store, self.key(rel))["size"])

    # -- deleting ---------------------------------------------------------------------------------

    def remove_file(self, rel: str) -> None:
        import obstore

        self._call(rel, "deleting", obstore.delete, self.store, self.key(rel))

    def remove_tree(self, rel: str) -> None:
        """Delete every object under ``rel/`` (manifest first, so the prefix stops being a checkpoint at
        once) and the object ``rel`` itself; missing is fine."""
        import obstore

        try:
            keys = [o["path"] for o in self.list_objects(rel)]
        except FileNotFoundError:
            keys = []
        manifest = f"{self.key(rel)}/{MANIFEST}"
        if manifest in keys:
            self._call(rel, "deleting", obstore.delete, self.store, manifest)
            keys.remove(manifest)
        for i in range(0, len(keys), 1000):
            self._call(rel, "deleting", obstore.delete, self.store, keys[i : i + 1000])
        try:
            obstore.delete(self.store, self.key(rel))
        except Exception:  # noqa: BLE001 - usually no object of that exact name
            pass

    # -- writing ----------------------------------------------------------------------------------

    def open_writer(self, rel: str, size_hint: int) -> ByteWriter:
        return S3Writer(self, rel, size_hint)

    def write_small(self, rel: str, data: bytes) -> None:
        """One PUT: the object appears whole or not at all (how the manifest commits a checkpoint)."""
        import obstore

        self._call(rel, "writing", obstore.put, self.store, self.key(rel), bytes(data), use_multipart=False)

    def put_file(self, rel: str, path: str, *, concurrency: int | None = None) -> None:
        """Upload the local file ``path`` as ``rel``: read by the client library itself (no Python loop, no
        copies on our side, the GIL released throughout), one PUT up to ``part_size``, else a multipart
        upload of ``part_size`` parts, ``concurrency`` (default: the options') at once; a failed multipart
        upload is aborted, no parts stay behind. For copying committed files (tiered replication)."""
        import pathlib

        import obstore

        opts = self.options
        multipart = os.path.getsize(path) > opts.part_size
        self._call(
            rel,
            "uploading",
            obstore.put,
            self.store,
            self.key(rel),
            pathlib.Path(path),
            use_multipart=multipart,
            chunk_size=opts.part_size,
            max_concurrency=concurrency or opts.concurrency,
        )

    def rename(self, src: str, dst: str) -> None:
        """Copy then delete (object stores have no rename): only small handshake files are moved this way;
        a prefix is copied with its manifest last and the source's manifest deleted first."""
        import obstore

        keys = []
        try:
            obstore.head(self.store, self.key(src))
            keys = [(self.key(src), self.key(dst))]
        except FileNotFoundError:
            base = self.key(src)
            objs = sorted(self.list_objects(src), key=lambda o: o["path"].endswith("/" + MANIFEST))
            keys = [(o["path"], self.key(dst) + o["path"][len(base) :]) for o in objs]
            if not keys:
                raise FileNotFoundError(errno.ENOENT, f"nothing to rename at {self.url(src)}", self.url(src)) from None
        except Exception as exc:
            raise self._error(exc, src, "renaming") from exc
        for a, b in keys:
            self._call(src, "copying", obstore.copy, self.store, a, b)
        for a, _ in sorted(keys, key=lambda k: not k[0].endswith(MANIFEST)):
            self._call(src, "deleting", obstore.delete, self.store, a)

    # -- reading ----------------------------------------------------------------------------------

    def read_small(self, rel: str) -> bytes:
        import obstore

        def get() -> bytes:
            return bytes(obstore.get(self.store, self.key(rel)).bytes())

        data: bytes = self._call(rel, "reading", get)
        return data

    async def _get_into_async(self, rel: str, parts: list[tuple[int, memoryview]], limit: Any) -> None:
        """One ranged GET covering ``parts`` ((offset, destination) in file order), copied into them."""
        import obstore

        begin = parts[0][0]
        end = parts[-1][0] + parts[-1][1].nbytes
        try:
            async with limit:
                data = await obstore.get_range_async(self.store, self.key(rel), start=begin, length=end - begin)
        except Exception as exc:
            raise self._error(exc, rel, "reading") from exc
        got = memoryview(data).cast("B")
        if got.nbytes != end - begin:
            raise CheckpointError(
                f"{self.url(rel)}: object ends before byte {end} (got {got.nbytes} of {end - begin} bytes at offset "
                f"{begin})",
                offset=begin,
            )
        for off, dest in parts:
            dest[:] = got[off - begin : off - begin + dest.nbytes]

    def _run(self, coro: Any) -> Any:
        """Run a coroutine to completion on a fresh event loop of the calling thread (callers are plain
        threads: the loader's readers)."""
        import asyncio

        return asyncio.run(coro)

    def read_into(self, rel: str, offset: int, dest: memoryview) -> None:
        self.read_ranges(rel, [(offset, dest)])

    def read_ranges(self, rel: str, ranges: Iterable[tuple[int, memoryview]]) -> None:
        """Parallel ranged GETs (``concurrency`` at once), each copied straight into its destinations as it
        arrives, so memory in flight is bounded by ``concurrency * read_size``.

        Ranges are cut into pieces of at most ``read_size`` bytes, and neighbours (at most ``GAP`` bytes
        apart, the padding between a file's tensors) share one request of at most ``read_size``: a
        checkpoint of many small tensors costs few requests, and a partial load fetches only what it
        asked for plus those gaps. Requests run as async tasks on one event loop: obstore's blocking
        calls from many threads measured several times slower here."""
        size = self.options.read_size or self.options.part_size
        pieces: list[tuple[int, memoryview]] = []
        for offset, dest in ranges:
            view = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
            for start in range(0, view.nbytes, size):
                pieces.append((offset + start, view[start : start + size]))
        if not pieces:
            return
        pieces.sort(key=lambda p: p[0])
        requests: list[list[tuple[int, memoryview]]] = []
        for off, view in pieces:
            if requests:
                first, (last_off, last_view) = requests[-1][0][0], requests[-1][-1]
                end = last_off + last_view.nbytes
                if 0 <= off - end <= GAP and off + view.nbytes - first <= size:
                    requests[-1].append((off, view))
                    continue
            requests.append([(off, view)])
        self._run(self._gather(rel, requests))

    async def _gather(self, rel: str, requests: list[list[tuple[int, memoryview]]]) -> None:
        import asyncio

        limit = asyncio.Semaphore(self.options.concurrency)
        tasks = [asyncio.ensure_future(self._get_into_async(rel, parts, limit)) for parts in requests]
        try:
            await asyncio.gather(*tasks)
        finally:  # on an error no request may still write into the caller's memory once we return
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _short(text: str, limit: int = 300) -> str:
    """One line of a client error: without the client's debug dump, at most ``limit`` characters."""
    text = " ".join(text.split("Debug source:", 1)[0].split())
    return text if len(text) <= limit else text[:limit] + "..."


_END = object()


class _Abort(StorageError):
    """Raised inside the upload's input to make ``obstore`` abort its multipart upload; caught here, never seen
    by a caller."""


class S3Writer(ClosingWriter):
    """One object written as a stream: small ones in one PUT at :meth:`close`, larger ones as a parallel
    multipart upload that starts with the first bytes (see the module docstring).

    ``write(view, borrow=True)`` hands the caller's memory to the upload without a copy (the caller
    keeps it unchanged until :meth:`close` returns, the ``ByteWriter`` contract); other writes are
    copied. The queue between the caller and the upload holds at most ``2 * part_size`` of copies,
    and the upload at most ``concurrency`` parts, so memory stays bounded whatever the file's size.
    """

    def __init__(self, storage: S3Storage, rel: str, size_hint: int) -> None:
        self.storage, self.rel = storage, rel
        self.size = 0
        opts = storage.options
        self._multipart = size_hint > opts.part_size
        self._small: list[bytes | memoryview] = []
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queued = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def _feed(self) -> Iterator[memoryview]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if item is _Abort:
                raise _Abort("upload aborted by the writer")
            view, copied = item
            if copied:
                with self._cond:
                    self._queued -= view.nbytes
                    self._cond.notify_all()
            yield view

    def _upload(self) -> None:
        import obstore

        opts = self.storage.options
        try:
            obstore.put(
                self.storage.store,
                self.storage.key(self.rel),
                self._feed(),
                use_multipart=True,
                chunk_size=opts.part_size,
                max_concurrency=opts.concurrency,
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the writer's thread
            self._error = exc
            with self._cond:
                self._cond.notify_all()
            while True:  # drain: a writer blocked on the queue's bound must not wait forever
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def _raise(self) -> None:
        exc = self._error
        if exc is None:
            return
        if isinstance(exc, _Abort):
            raise CheckpointError(f"upload of {self.storage.url(self.rel)} was aborted")
        raise self.storage._error(exc, self.rel, "uploading") from exc

    def write(self, data: Any, *, borrow: bool = False) -> None:
        if self._closed:
            raise ValueError(f"{self.storage.url(self.rel)}: write after close")
        view = as_bytes_view(data)
        if view.nbytes == 0:
            return
        self.size += view.nbytes
        if not self._multipart:
            self._small.append(view if borrow else bytes(view))
            return
        self._raise()
        if self._thread is None:
            self._thread = threading.Thread(target=self._upload, name="ucp-s3-put", daemon=True)
            self._thread.start()
        if borrow:
            self._queue.put((view, False))
            return
        limit = 2 * self.storage.options.part_size
        with self._cond:
            while self._queued > 0 and self._queued + view.nbytes > limit and self._error is None:
                self._cond.wait(0.5)
            self._queued += view.nbytes
        self._raise()
        self._queue.put((memoryview(bytes(view)), True))

    def close(self) -> int:
        if self._closed:
            return self.size
        self._closed = True
        if not self._multipart:
            data = b"".join(self._small)
            self._small = []
            self.storage.write_small(self.rel, data)
            return self.size
        if self._thread is None:  # announced as large, written empty
            self.storage.write_small(self.rel, b"")
            return self.size
        self._queue.put(_END)
        self._thread.join()
        self._raise()
        return self.size

    def abort(self) -> None:
        """Stop the upload (its multipart upload is aborted, no parts stay behind) and delete the object."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_Abort)
            self._thread.join()
        self._closed = True
        self._small = []
        try:
            self.storage.remove_file(self.rel)
        except (OSError, CheckpointError):
            pass


def parse_options(url: str, storage_options: dict[str, Any] | None) -> S3Options:
    """``storage_options`` of ``url`` checked; StorageError naming the URL and each bad field."""
    from pydantic import ValidationError

    try:
        return S3Options.model_validate(storage_options or {})
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
        raise StorageError(f"bad storage options for {url}: {detail}") from None


def open_s3(url: str, storage_options: dict[str, Any] | None) -> tuple[S3Storage, str]:
    """The storage holding checkpoint ``url`` (its parent prefix) and the checkpoint's name in it."""
    opts = parse_options(url, storage_options)
    bucket, key = split_url(url)
    parent, _, name = key.rpartition("/")
    if not name:
        raise CheckpointError(f"checkpoint path {url!r} has no final component")
    return S3Storage(bucket, parent, opts), name
