"""Reading data files: the manifest, safetensors headers, whole files and byte ranges, with CRC checks.

Whole files are read in segments by two threads while the caller checksums
the segments already in (``crc32c`` releases the GIL), so verification costs
little beyond the read itself. Every check failure raises a
:class:`~ucp.errors.CheckpointError` naming the tensor, file and offset.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import crc32c as _crc32c

from aio import AlignedBuffer
from aio.populate import Populator
from ucp.errors import CorruptCheckpointError, ManifestError, MissingDataError, NotACheckpointError, where
from ucp.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, Piece, parse_manifest, too_large
from ucp.format.tree import PAD_PREFIX
from ucp.store.storage import Storage, open_storage

if TYPE_CHECKING:
    import torch

SEGMENT = 64 << 20  # whole-file reads: bytes per request batch (a multiple of 4096)
READ_AHEAD = 2  # segments in flight while the caller checksums
# Whole-file buffers at least this large are faulted in ahead of their reads (FileBuffer.populate).
# One thread: measured on a RAM-backed loop device (3.4 GB/s) a 2 GiB fresh-process load took
# 1.25 s populated vs 1.46 s faulting in the reads; two populating threads were no faster on 2 cores.
POPULATE_MIN_BYTES = 4 << 20
POPULATE_THREADS = 1


@dataclass(frozen=True)
class FilePiece:
    """A piece together with the tensor it belongs to."""

    tensor: str
    dtype: str
    shape: tuple[int, ...]
    piece: Piece

    @property
    def entry(self) -> str:
        """The piece's entry name in its file's safetensors header."""
        return self.piece.entry if self.piece.entry is not None else self.tensor


def read_checkpoint_manifest(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> Manifest:
    """Read and check the manifest of the checkpoint at ``path`` (no data is read)."""
    storage, name = open_storage(path, storage_options=storage_options)
    with storage:
        return read_manifest(storage, name)


def read_manifest(storage: Storage, name: str) -> Manifest:
    """Read and check ``<name>/manifest.json``; NotACheckpointError when absent."""
    rel = f"{name}/{MANIFEST_NAME}"
    try:
        data = _read_manifest_bytes(storage, rel)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        if not _exists(storage, name):
            raise NotACheckpointError(f"{storage.describe(name)} does not exist") from None
        raise NotACheckpointError(
            f"{storage.describe(name)} is not a checkpoint: no {MANIFEST_NAME} (not a checkpoint, "
            "or a save that never committed)"
        ) from None
    return parse_manifest(data, source=storage.describe(rel))


def _exists(storage: Storage, name: str) -> bool:
    """Whether ``name`` exists at all (a missing path is told apart from a folder without a manifest);
    True when the storage cannot say, so the message falls back to "no manifest.json"."""
    try:
        return storage.exists(name)
    except OSError:
        return True


def _read_manifest_bytes(storage: Storage, rel: str) -> bytes:
    """The manifest's bytes. A local manifest must be a regular file: opening a FIFO named
    manifest.json would block forever, a device would never end. So the file is opened without
    blocking and checked (fstat) before it is read; a directory counts as no manifest."""
    storage.check_contained(rel)  # a manifest linked from outside the checkpoint is not its manifest
    path = storage.local_path(rel)
    if path is None:
        size = storage.size(rel)
        if size > MAX_MANIFEST_BYTES:  # refused before it is read whole
            raise ManifestError(too_large(storage.describe(rel), size))
        return storage.read_small(rel)
    return read_regular_file(path, storage.describe(rel))


def read_regular_file(path: str, where: str, *, limit: int | None = None) -> bytes:
    """A local manifest's bytes, refusing anything but a regular file without blocking on it
    (IsADirectoryError for a directory, ManifestError naming ``where`` for a FIFO, device...) and
    a file over ``limit`` bytes (default :data:`MAX_MANIFEST_BYTES`), checked before it is read.
    At most ``limit + 1`` bytes are read, so a file growing meanwhile is refused by the parser."""
    limit = MAX_MANIFEST_BYTES if limit is None else limit
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{where}: is not a regular file ({file_type(st.st_mode)})")
        if st.st_size > limit:
            raise ManifestError(too_large(where, st.st_size))
        os.set_blocking(fd, True)
        return f.read(limit + 1)


def file_type(mode: int) -> str:
    """What a non-regular file is, for messages: 'a directory', 'a FIFO', ..."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((word for test, word in kinds if test(mode)), "a special file")


def pieces_by_file(manifest: Manifest) -> dict[str, list[FilePiece]]:
    """Every file's pieces, in file order."""
    out: dict[str, list[FilePiece]] = {f: [] for f in manifest.files}
    for name, t in manifest.tensors.items():
        for p in t.pieces:
            out[p.file].append(FilePiece(name, t.dtype, tuple(t.shape), p))
    for lst in out.values():
        lst.sort(key=lambda fp: fp.piece.offset)
    return out


# -- files and headers ----------------------------------------------------------------------------


def check_file_size(storage: Storage, name: str, file: str, expected: int) -> None:
    """The data file exists, is a regular file (locally: not a directory, FIFO, ...) and has the
    manifest's size."""
    rel = f"{name}/{file}"
    storage.check_contained(rel)  # a data file linked from outside the checkpoint holds foreign bytes
    try:
        path = storage.local_path(rel)
        if path is not None:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(
                    f"{where(file=file)}: data file {storage.describe(rel)} is not a "
                    f"regular file but {file_type(st.st_mode)}",
                    file=file,
                )
            size = st.st_size
        else:
            size = storage.size(rel)
    except FileNotFoundError:
        raise MissingDataError(f"{where(file=file)}: data file {storage.describe(rel)} is missing", file=file) from None
    if size != expected:
        kind = "truncated" if size < expected else "longer than expected"
        raise CorruptCheckpointError(
            f"{where(file=file)}: {kind}: {size} bytes on storage, the manifest says {expected}", file=file
        )


def check_data_files(storage: Storage, name: str, manifest: Manifest) -> None:
    """Every data file the manifest lists exists and has the size it claims.

    A manifest's shapes, lengths and file sizes only agree with each other; nothing backs them
    until the files on storage do. Loads, exports and reshapes call this right after reading the
    manifest, before allocating memory or preallocating output from those numbers, so a small
    checkpoint claiming huge tensors fails on its data file instead of on an allocation.
    """
    for file, info in manifest.files.items():
        check_file_size(storage, name, file, info.size)


def parse_header(file: str, head: memoryview | bytes, file_size: int) -> tuple[int, dict[str, Any]]:
    """(data start, header dict) of a safetensors file from its first bytes; raises on a malformed header."""
    if len(head) < 8:
        raise CorruptCheckpointError(
            f"{where(file=file, offset=0)}: too short for a safetensors header", file=file, offset=0
        )
    (n,) = struct.unpack("<Q", bytes(head[:8]))
    if 8 + n > file_size or 8 + n > len(head):
        raise CorruptCheckpointError(
            f"{where(file=file, offset=0)}: safetensors header length {n} runs past the data read ({len(head)} bytes)",
            file=file,
            offset=0,
        )
    try:
        header = json.loads(bytes(head[8 : 8 + n]))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"{where(file=file, offset=8)}: safetensors header is not valid JSON ({exc})", file=file, offset=8
        ) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(
            f"{where(file=file, offset=8)}: safetensors header is not a JSON object", file=file, offset=8
        )
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        # safetensors reads it as an optional map of strings to strings and refuses the file otherwise
        raise CorruptCheckpointError(
            f"{where(file=file, offset=8)}: safetensors header's '__metadata__' must map strings to strings, "
            f"got {_describe_json(meta)} (safetensors refuses such a file)",
            file=file,
            offset=8,
        )
    return 8 + n, header


def _describe_json(value: Any) -> str:
    """A short description of a JSON value for messages (never its whole text)."""
    if isinstance(value, dict):
        bad = next((k for k, v in value.items() if not isinstance(v, str)), None)
        return f"key {bad!r} holding {type(value[bad]).__name__}"[:200] if bad is not None else "a map"
    return f"a JSON {type(value).__name__}"


def header_length(file: str, head: memoryview | bytes) -> int:
    """Bytes needed to hold the whole header (8 + N) from its first 8 bytes."""
    if len(head) < 8:
        raise CorruptCheckpointError(
            f"{where(file=file, offset=0)}: too short for a safetensors header", file=file, offset=0
        )
    return 8 + struct.unpack("<Q", bytes(head[:8]))[0]


def check_header(file: str, data_start: int, header: dict[str, Any], pieces: Sequence[FilePiece]) -> None:
    """The header must list exactly the manifest's pieces of this file, with their dtype, shape and offsets."""
    names = {k for k in header if k != "__metadata__" and not k.startswith(PAD_PREFIX)}
    expected = {fp.entry for fp in pieces}
    for k in header.keys() - names - {"__metadata__"}:
        entry = header[k]
        if not (
            isinstance(entry, dict)
            and entry.get("dtype") == "U8"
            and isinstance(entry.get("shape"), list)
            and len(entry["shape"]) == 1
        ):
            raise CorruptCheckpointError(f"{where(file=file)}: padding entry {k!r} must be a 1-d U8 entry", file=file)
    if names != expected:
        extra, missing = sorted(names - expected)[:3], sorted(expected - names)[:3]
        raise CorruptCheckpointError(
            f"{where(file=file)}: safetensors header disagrees with the manifest "
            f"(header only: {extra}, manifest only: {missing})",
            file=file,
        )
    for fp in pieces:
        p = fp.piece
        entry = header[fp.entry]
        want = {
            "dtype": fp.dtype,
            "shape": p.local_shape(),
            "data_offsets": [p.offset - data_start, p.offset - data_start + p.length],
        }
        got = {k: entry.get(k) for k in want} if isinstance(entry, dict) else entry
        if got != want:
            raise CorruptCheckpointError(
                f"{where(fp.tensor, file, p.offset)}: safetensors header says {got}, the manifest {want}",
                tensor=fp.tensor,
                file=file,
                offset=p.offset,
            )


def read_and_check_header(storage: Storage, name: str, file: str, size: int, pieces: Sequence[FilePiece]) -> int:
    """Read a file's header with a small read and check it; returns the data start."""
    rel = f"{name}/{file}"
    first = min(size, 4096)
    buf = AlignedBuffer(first)
    storage.read_into(rel, 0, buf.view(first))
    need = header_length(file, buf.view(first))
    if need > first:
        if need > size:
            raise CorruptCheckpointError(
                f"{where(file=file, offset=0)}: header length {need} exceeds the file size {size}", file=file, offset=0
            )
        buf = AlignedBuffer(need)
        storage.read_into(rel, 0, buf.view(need))
    data_start, header = parse_header(file, buf.view(need), size)
    check_header(file, data_start, header, pieces)
    return data_start


# -- CRC checks -----------------------------------------------------------------------------------


def crc_error(fp: FilePiece, file: str, got: int) -> CorruptCheckpointError:
    p = fp.piece
    return CorruptCheckpointError(
        f"{where(fp.tensor, file, p.offset)}: CRC-32C mismatch over {p.length} bytes "
        f"(stored {p.crc32c:#010x}, read {got:#010x}): the data is corrupt",
        tensor=fp.tensor,
        file=file,
        offset=p.offset,
    )


def check_crc(fp: FilePiece, file: str, data: memoryview | Any) -> None:
    got = _crc32c.crc32c(data)
    if got != fp.piece.crc32c:
        raise crc_error(fp, file, got)


class CrcTracker:
    """Checksums pieces from consecutive segments of a file as they arrive."""

    def __init__(self, file: str, pieces: Sequence[FilePiece]) -> None:
        self.file = file
        self.pieces = sorted(pieces, key=lambda fp: fp.piece.offset)
        self._next = 0  # first piece not finished
        self._crc: dict[int, int] = {}

    def feed(self, offset: int, data: memoryview) -> None:
        """Account for file bytes ``[offset, offset + len(data))``; segments must come in order."""
        end = offset + data.nbytes
        i = self._next
        while i < len(self.pieces):
            p = self.pieces[i].piece
            if p.offset >= end and p.length:
                break
            lo, hi = max(p.offset, offset), min(p.offset + p.length, end)
            if hi > lo:
                self._crc[i] = _crc32c.crc32c(data[lo - offset : hi - offset], self._crc.get(i, 0))
            if p.offset + p.length <= end:
                got = self._crc.pop(i, 0)
                if got != p.crc32c:
                    raise crc_error(self.pieces[i], self.file, got)
                if i == self._next:
                    self._next += 1
            i += 1

    def finish(self) -> None:
        if self._next < len(self.pieces):
            fp = self.pieces[self._next]
            raise CorruptCheckpointError(
                f"{where(fp.tensor, self.file, fp.piece.offset)}: the file ended before the piece",
                tensor=fp.tensor,
                file=self.file,
                offset=fp.piece.offset,
            )


# -- whole files ----------------------------------------------------------------------------------


class FileBuffer:
    """Page-aligned memory for a whole data file, faulted in *while* it is read.

    ``aio.AlignedBuffer`` pre-faults its pages (``MAP_POPULATE``) before any I/O starts;
    for a multi-GiB file that zero-fill is a serial cost as large as the read itself on
    our test machine. Left alone, the kernel faults pages in as each O_DIRECT request is
    submitted, in the submitting thread (measured: 1.2 vs 1.0 GB/s against fio's 1.34 on a
    1.5 GiB file). :meth:`populate` does better: another thread faults the buffer in, in
    order, ahead of the reads (:class:`aio.populate.Populator`), and the reader waits on
    :meth:`ready` before each request, so requests find their pages mapped. Tensors loaded
    zero-copy view this memory; a fresh buffer per load, so two loads never share memory.
    """

    def __init__(self, nbytes: int, memory: mmap.mmap | None = None) -> None:
        """``memory``: a mapping of at least ``nbytes`` to use (from a :class:`MemoryPool`), else a new one."""
        self.nbytes = nbytes
        self._mmap = _anonymous(nbytes) if memory is None else memory
        self._view = memoryview(self._mmap)
        self._populator: Populator | None = None

    def populate(self, threads: int = POPULATE_THREADS) -> None:
        """Start faulting the buffer in, in order, on other threads (:class:`aio.populate.Populator`);
        readers call :meth:`ready` before filling a range, so their requests find the pages mapped."""
        if self._populator is None and self.nbytes >= POPULATE_MIN_BYTES:
            self._populator = Populator(self._mmap, self.nbytes, threads=threads)

    def ready(self, end: int) -> None:
        """Block until ``[0, end)`` is faulted in, when :meth:`populate` was started (else at once)."""
        if self._populator is not None:
            self._populator.wait(end)

    def done_populating(self) -> None:
        """Stop (and wait for) the populating threads."""
        if self._populator is not None:
            self._populator.close()
            self._populator = None

    @property
    def memory(self) -> mmap.mmap:
        """The mapping itself (for :class:`aio.populate.Populator`)."""
        return self._mmap

    def view(self, nbytes: int | None = None, offset: int = 0) -> memoryview:
        end = self.nbytes if nbytes is None else offset + nbytes
        if offset < 0 or end > self.nbytes:
            raise ValueError(f"view [{offset}, {end}) outside buffer of {self.nbytes} bytes")
        return self._view[offset:end]

    def tensor(self, nbytes: int, offset: int = 0) -> "torch.Tensor":
        """A uint8 tensor viewing ``[offset, offset + nbytes)`` (keeps the buffer alive)."""
        import torch

        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.view(nbytes, offset), dtype=torch.uint8)


def _anonymous(nbytes: int) -> mmap.mmap:
    return mmap.mmap(
        -1, max(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )


class MemoryPool:
    """Mappings of one size for :class:`FileBuffer`, each reused once nothing views its memory any more.

    Why: on the reference VM, faulting in fresh anonymous pages costs ~0.6 s per GB (freed guest
    memory goes back to the host), about what reading them from disk costs; a reshape or convert
    fills a new batch buffer and its read staging for every few dozen MB it copies. A mapping is free
    when no buffer of it is exported: ``mmap.resize`` to its own size is refused while one is. Every
    view of a FileBuffer (its slices, numpy arrays over them, an I/O request in flight holding its
    memoryview) keeps the mapping exported, so memory is reused exactly when it would otherwise be
    freed. The pool holds at most as many mappings as were ever in use at once.

    ``limit``: the most mappings it may hold (a memory budget's count). At the limit, :meth:`buffer`
    waits for one to come free instead of mapping another: when memory is let go depends on other
    threads (a checksum thread or a write request still reading a batch the caller is done with), so
    under load "free by now" is not a promise, and a budget that counted on it was exceeded. The
    caller's pipeline must release mappings without waiting on the one asking (reshape's does: the
    writer, its checksum thread and its requests in flight progress on their own).
    """

    WAIT_SLICE = 0.001  # seconds between probes while every mapping is in use
    GC_AFTER = 0.1  # seconds of waiting before a garbage collection (a reference cycle may hold a view)

    def __init__(self, size: int, limit: int | None = None, abandon: threading.Event | None = None) -> None:
        """``abandon``: once set, a caller waiting at the limit gets a RuntimeError instead (the work the
        memory is for was given up, and what holds the mappings, e.g. an error's traceback, may never let go)."""
        if limit is not None and limit < 1:
            raise ValueError(f"a memory pool needs room for one mapping at least, not {limit}")
        self.size = size
        self.limit = limit
        self.abandon = abandon
        self.waits = 0  # how often buffer() found every mapping in use at the limit (for tests and tuning)
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._reusable = True  # False where resize() cannot probe (another platform): plain FileBuffers

    def buffer(self, nbytes: int) -> FileBuffer:
        """A FileBuffer of ``nbytes`` (its contents are whatever the memory last held); at the limit,
        waits until one of the pool's mappings is no longer viewed."""
        if nbytes > self.size or not self._reusable:
            return FileBuffer(nbytes)
        waited, collected = 0.0, False
        while True:
            with self._lock:  # the FileBuffer (an export) exists before another caller probes the mapping
                for m in self._maps:
                    if self._free(m):
                        return FileBuffer(nbytes, m)
                if not self._reusable:
                    return FileBuffer(nbytes)
                if self.limit is None or len(self._maps) < self.limit:
                    m = _anonymous(self.size)
                    self._maps.append(m)
                    return FileBuffer(nbytes, m)
                if waited == 0.0:
                    self.waits += 1
            if self.abandon is not None and self.abandon.is_set():
                raise RuntimeError("abandoned while waiting for memory from the pool")
            if waited >= self.GC_AFTER and not collected:
                import gc

                gc.collect()
                collected = True
            time.sleep(self.WAIT_SLICE)
            waited += self.WAIT_SLICE

    def _free(self, m: mmap.mmap) -> bool:
        try:
            m.resize(len(m))
        except BufferError:
            return False
        except (OSError, ValueError, SystemError, TypeError):  # resize unsupported: stop pooling
            self._reusable = False
            return False
        return True


def segments(size: int, segment: int = SEGMENT) -> list[tuple[int, int]]:
    return [(off, min(segment, size - off)) for off in range(0, size, segment)]


def stream_file(
    storage: Storage,
    rel: str,
    size: int,
    *,
    into: FileBuffer | AlignedBuffer | None = None,
    segment: int = SEGMENT,
    ahead: int = READ_AHEAD,
) -> Iterator[tuple[int, memoryview]]:
    """Yield ``(offset, bytes)`` for consecutive segments of a file, reading ``ahead`` segments in parallel.

    With ``into`` the file lands in that buffer (at the same offsets); without it segments
    rotate through ``ahead + 1`` scratch buffers, so a yielded view is valid until the next one.
    """
    segs = segments(size, segment)
    scratch = (
        None if into is not None else [AlignedBuffer(min(segment, size)) for _ in range(min(ahead + 1, len(segs)))]
    )

    def dest(i: int) -> memoryview:
        off, n = segs[i]
        if into is not None:
            return into.view(n, off)
        assert scratch is not None  # made whenever there is no ``into``
        return scratch[i % len(scratch)].view(n)

    def ready(i: int) -> None:  # a populating FileBuffer: let its pages be mapped before the request goes out
        if isinstance(into, FileBuffer):
            into.ready(segs[i][0] + segs[i][1])

    with ThreadPoolExecutor(max_workers=ahead, thread_name_prefix="ucp-read") as pool:
        futures: dict[int, Future] = {}
        try:
            for i in range(min(ahead, len(segs))):
                ready(i)
                futures[i] = pool.submit(storage.read_into, rel, segs[i][0], dest(i))
            for i, (off, _) in enumerate(segs):
                futures.pop(i).result()
                view = dest(i)
                yield off, view
                j = i + ahead
                if j < len(segs):
                    ready(j)
                    futures[j] = pool.submit(storage.read_into, rel, segs[j][0], dest(j))
        finally:
            for fut in futures.values():
                fut.cancel()
            for fut in futures.values():
                try:
                    fut.result()
                except BaseException:
                    pass


def read_whole_file(
    storage: Storage, name: str, file: str, size: int, pieces: Sequence[FilePiece], *, verify: bool
) -> tuple[FileBuffer, int]:
    """Read a data file into one aligned buffer, checking its header and (``verify``) every piece's CRC.

    Returns the buffer and the data start.
    """
    check_file_size(storage, name, file, size)
    buf = FileBuffer(size)
    buf.populate()
    try:
        return _fill_whole(storage, name, file, size, pieces, buf, verify=verify)
    finally:
        buf.done_populating()


def _fill_whole(
    storage: Storage, name: str, file: str, size: int, pieces: Sequence[FilePiece], buf: FileBuffer, *, verify: bool
) -> tuple[FileBuffer, int]:
    tracker = CrcTracker(file, pieces) if verify else None
    data_start = None
    for off, view in stream_file(storage, f"{name}/{file}", size, into=buf):
        end = off + view.nbytes
        if data_start is None and (end == size or (end >= 8 and header_length(file, buf.view(8)) <= end)):
            data_start, header = parse_header(file, buf.view(end), size)
            check_header(file, data_start, header, pieces)
        if tracker is not None:
            tracker.feed(off, view)
    if data_start is None:  # an empty file
        data_start, header = parse_header(file, buf.view(), size)
    if tracker is not None:
        tracker.finish()
    return buf, data_start
