"""Filling tensors (or parts of them) from the stored pieces that intersect them: the ``into=`` reads.

For each target (a buffer holding a box or flat range of a logical tensor) the
pieces that intersect it are found with ``reshard.box`` and read:

* straight into the target's memory when the piece holds exactly the target's
  elements in the same order and dtype (a reload with the saved layout);
* otherwise into a staging buffer, then copied (with a dtype cast if needed)
  into every target that wants part of it: the span of the piece the targets
  need, rounded out to 4 KiB so that the read is O_DIRECT-aligned, and cut into
  parts of at most the staging's size when larger. When verifying, a piece that
  fits the staging is read whole (its CRC covers all of it); a larger one is read
  span by span and checksummed as its spans arrive in order, the rest of it read
  at the end (:meth:`SourceIndex.finish`), so that memory stays bounded by the
  staging, not by the largest tensor.

Reads are grouped in batches of about ``BATCH_BYTES``; the next ``READ_AHEAD``
batches are read while batch k is checksummed and copied.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import crc32c as _crc32c

from reshard.box import Box, FlatRange, element_span, split_region, transfers
from ucp.errors import CheckpointError
from ucp.format.dtypes import itemsize, torch_dtype
from ucp.format.manifest import Manifest
from ucp.format.regions import Buffer, RawArray, as_flat_range, copy_region, is_numpy, same_elements
from ucp.store.reader import (
    FileBuffer,
    FilePiece,
    MemoryPool,
    check_crc,
    check_file_size,
    crc_error,
    pieces_by_file,
    read_and_check_header,
)
from ucp.store.storage import Storage

BATCH_BYTES = 128 << 20
READ_AHEAD = 2  # batches in flight while the previous one is checked and copied
ALIGN = 4096


@dataclass
class Target:
    """A tensor (or part of one) to fill: ``buffer`` holds ``region`` of tensor ``name``.

    ``buffer`` is a torch tensor (of any dtype: elements are cast), or a :class:`~ucp.format.regions.RawArray`
    (or numpy array of ``numpy.dtype("V<n>")``) of the stored dtype's item size: bytes moved as they are,
    no torch needed.
    """

    name: str
    buffer: Buffer
    region: Box | FlatRange
    path: tuple[Any, ...] = ()


@dataclass
class _Need:
    """One stored piece to read, and who wants it."""

    fp: FilePiece
    targets: list[Target]
    direct: Target | None = None  # read straight into this target's memory
    direct_at: int = 0  # ... at this element offset
    direct_from: int = 0  # ... elements [direct_from, direct_from + direct_count) of the piece
    direct_count: int | None = None  # None: all of the piece
    check: bool = True  # verify this piece's CRC (then it is read whole)
    stream: bool = False  # verify it span by span instead (a staged piece larger than the staging)
    part: Box | FlatRange | None = None  # staged: only this part of the piece (a span cut to fit the staging) ...
    part_first: int = 0  # ... which is elements [part_first, part_first + part.numel) of the piece's buffer
    first: int = 0  # staged: first element of the piece read
    read_at: int = 0  # staged: file offset of the (aligned) read
    read_len: int = 0
    skip: int = 0  # staged: bytes between read_at and the first element


@dataclass
class _Batch:
    needs: list[_Need] = field(default_factory=list)
    staging: int = 0  # bytes of staging buffer the staged needs use
    nbytes: int = 0


def _takes_stored_bytes(t: Target, fp: FilePiece) -> bool:
    """Whether the piece's bytes can land in ``t.buffer``'s memory as they are (same dtype, contiguous host memory)."""
    b = t.buffer
    if isinstance(b, RawArray):
        return b.itemsize == itemsize(fp.dtype) and not b.readonly
    if is_numpy(b):
        return b.itemsize == itemsize(fp.dtype) and b.flags.c_contiguous and b.flags.writeable
    return not (
        b.device.type != "cpu"
        or b.dtype != torch_dtype(fp.dtype)
        or not b.is_contiguous()
        or b.requires_grad
        or b.is_conj()
        or b.is_neg()
    )  # conjugate/negative views: memory is not the values


def _direct_offset(t: Target, fp: FilePiece) -> int | None:
    """Element offset in ``t.buffer`` where the whole piece can be read straight in, else None.

    That is when the piece's elements form one run of the target's, in order (the same region,
    or both contiguous in the global tensor with the piece inside the target: a row block of a
    whole tensor, a flat ZeRO partition inside a row block...).
    """
    if not _takes_stored_bytes(t, fp):
        return None
    region = fp.piece.region()
    if same_elements(t.region, region, fp.shape):
        return 0
    inner, outer = as_flat_range(region, fp.shape), as_flat_range(t.region, fp.shape)
    if inner is None or outer is None or not (outer.start <= inner.start and inner.stop <= outer.stop):
        return None
    return inner.start - outer.start


def _direct_span(t: Target, fp: FilePiece) -> tuple[int, int, int] | None:
    """``(element in the piece, element in the target, count)`` when the elements the two share form
    one run of each, in order (both contiguous in the global tensor: a row slab of a larger stored
    block, a part of a flat partition...), so that part of the piece can be read straight in."""
    if not _takes_stored_bytes(t, fp):
        return None
    piece, target = as_flat_range(fp.piece.region(), fp.shape), as_flat_range(t.region, fp.shape)
    if piece is None or target is None:
        return None
    lo, hi = max(piece.start, target.start), min(piece.stop, target.stop)
    return (lo - piece.start, lo - target.start, hi - lo) if lo < hi else None


@dataclass
class _Running:
    """A piece checksummed span by span: its bytes ``[0, pos)`` went into ``crc``."""

    fp: FilePiece
    pos: int = 0
    crc: int = 0


@dataclass
class SourceIndex:
    """What repeated partial reads of one checkpoint share (e.g. a reshape's many batches).

    The pieces of each tensor with their files, which files' sizes and headers were already
    checked, and which pieces' CRCs are being or have been verified: a piece that fits the staging
    is claimed for verification by the first read that needs it (it reads the piece whole);
    concurrent and later reads take only the span they need. A larger piece is checksummed as its
    spans arrive (:meth:`feed`), in order; :meth:`finish` reads what no span brought in order and
    completes the check. Should a CRC be bad, the error fails the whole operation, so nothing read
    from that piece is ever committed.
    """

    manifest: Manifest
    files: dict[str, list[FilePiece]]
    by_tensor: dict[str, list[tuple[str, FilePiece]]]
    checked_files: set[str] = field(default_factory=set)
    claimed: set[tuple[str, int]] = field(default_factory=set)
    running: dict[tuple[str, int], _Running] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    staging: MemoryPool | None = None  # where reads that share this index take their staging (None: fresh memory)

    def feed(self, file: str, fp: FilePiece, start: int, data: memoryview) -> None:
        """Bytes ``[start, start + len(data))`` of a piece checksummed span by span; CorruptCheckpointError
        once all of it went in and the CRC differs. Bytes that do not continue the running CRC are left
        for :meth:`finish` (a span read ahead of its predecessor, or by another file's reader)."""
        key = (file, fp.piece.offset)
        with self.lock:
            if key in self.claimed:  # a whole read checks it
                return
            run = self.running.setdefault(key, _Running(fp))
            end = min(start + data.nbytes, fp.piece.length)
            if not start <= run.pos < end:
                return
            run.crc = _crc32c.crc32c(data[run.pos - start : end - start], run.crc)
            run.pos = end
            if end < fp.piece.length:
                return
            self.claimed.add(key)  # done: later spans need no checking
            del self.running[key]
        if run.crc != fp.piece.crc32c:
            raise crc_error(fp, file, run.crc)

    def finish(self, storage: Storage, name: str, chunk_bytes: int = BATCH_BYTES) -> None:
        """Complete the check of every piece checksummed span by span: read what is left of each,
        ``chunk_bytes`` at a time (a staging's worth of memory)."""
        with self.lock:
            left = [(key, run) for key, run in self.running.items() if key not in self.claimed]
        if not left:
            return
        most = min(chunk_bytes, max(r.fp.piece.length - r.pos for _, r in left))
        nbytes = (most // ALIGN + 1) * ALIGN  # one page more: reads start at the aligned offset below
        # from the reads' staging pool where one is shared: a reshape's budget counts no memory beside it
        buf = self.staging.buffer(nbytes) if self.staging is not None else FileBuffer(nbytes)
        for (file, _), run in sorted(left, key=lambda kv: kv[0]):
            fp = run.fp
            while run.pos < fp.piece.length:
                start = fp.piece.offset + run.pos
                read_at = start - start % ALIGN
                size = min(buf.nbytes, self.manifest.files[file].size - read_at)
                storage.read_ranges(f"{name}/{file}", [(read_at, buf.view(size))])
                skip, before = start - read_at, run.pos
                self.feed(file, fp, run.pos, buf.view(min(size - skip, fp.piece.length - run.pos), skip))
                if (file, fp.piece.offset) in self.claimed:
                    break
                if run.pos == before:  # a bug, not a user error: the span did not continue the CRC
                    raise RuntimeError(f"checking {fp.tensor!r} in {file}: stuck at byte {before}")

    def claim(self, file: str, offset: int) -> bool:
        """True for the first caller that asks to verify this piece."""
        with self.lock:
            if (file, offset) in self.claimed:
                return False
            self.claimed.add((file, offset))
            return True

    @classmethod
    def of(cls, manifest: Manifest) -> "SourceIndex":
        files = pieces_by_file(manifest)
        by_tensor: dict[str, list[tuple[str, FilePiece]]] = defaultdict(list)
        for file, fps in files.items():
            for fp in fps:
                by_tensor[fp.tensor].append((file, fp))
        return cls(manifest, files, dict(by_tensor))


def read_targets(
    storage: Storage,
    name: str,
    manifest: Manifest,
    targets: Sequence[Target],
    *,
    verify: bool,
    index: SourceIndex | None = None,
    staging_bytes: int = BATCH_BYTES,
) -> None:
    """Fill every target from the pieces that intersect it.

    ``index``: shared across calls on the same checkpoint (see :class:`SourceIndex`); a piece
    another call claimed for verification is not checked again, and the caller calls
    ``index.finish`` once its last call is done. ``staging_bytes``: reads are grouped in batches of
    about this size; at most ``READ_AHEAD + 1`` batches of staging memory are held (a staged span
    larger than that is read alone); staged pieces larger than this are verified span by span.
    """
    own_index = index is None
    if index is None:
        index = SourceIndex.of(manifest)
    by_tensor: dict[str, list[Target]] = defaultdict(list)
    for t in targets:
        by_tensor[t.name].append(t)
        entry = manifest.tensors.get(t.name)
        raw = isinstance(t.buffer, RawArray) or is_numpy(t.buffer)
        if raw and entry is not None and t.buffer.itemsize != itemsize(entry.dtype):
            kind = "numpy" if is_numpy(t.buffer) else "raw"
            raise CheckpointError(
                f"tensor {t.name!r}: a {kind} target of {t.buffer.itemsize}-byte items cannot hold "
                f"{entry.dtype} elements ({itemsize(entry.dtype)} bytes; {kind} targets are not cast)"
            )
    needs: dict[str, list[_Need]] = defaultdict(list)
    for tensor, wanted in by_tensor.items():
        for file, fp in index.by_tensor.get(tensor, ()):
            region = fp.piece.region()
            wanting = [t for t in wanted if transfers(region, t.region, fp.shape)]
            if wanting:
                at = _direct_offset(wanting[0], fp) if len(wanting) == 1 else None
                stream = verify and at is None and fp.piece.length > staging_bytes
                if at is None and (stream or not verify):  # no whole read needed: read parts straight in
                    staged = []
                    for t in wanting:
                        span = _direct_span(t, fp)
                        if span is None:
                            staged.append(t)
                        else:
                            needs[file].append(
                                _Need(
                                    fp,
                                    [t],
                                    direct=t,
                                    direct_at=span[1],
                                    direct_from=span[0],
                                    direct_count=span[2],
                                    check=False,
                                    stream=stream,
                                )
                            )
                    if staged:
                        needs[file].extend(_staged_parts(_Need(fp, staged, check=False, stream=stream), staging_bytes))
                    continue
                check = verify and not stream and index.claim(file, fp.piece.offset)
                needs[file].append(
                    _Need(
                        fp,
                        wanting,
                        direct=wanting[0] if at is not None else None,
                        direct_at=at or 0,
                        check=check,
                        stream=stream,
                    )
                )
    for file in sorted(needs):
        file_needs = sorted(needs[file], key=lambda nd: (nd.fp.piece.offset, _first_element(nd)))  # sequential reads
        size = manifest.files[file].size
        if file not in index.checked_files:
            check_file_size(storage, name, file, size)
            read_and_check_header(storage, name, file, size, index.files[file])
            index.checked_files.add(file)
        _run(storage, f"{name}/{file}", file, _batches(file_needs, size, staging_bytes), index)
    if own_index:
        index.finish(storage, name, staging_bytes)


def _staged_parts(need: _Need, staging_bytes: int) -> list[_Need]:
    """A staged need whose span is larger than the staging, cut into needs of one part each (parts of the
    piece in its buffer order: :func:`reshard.box.split_region`), so that no read stages more than
    about ``staging_bytes``; each part goes to the targets that want some of it."""
    fp = need.fp
    size = itemsize(fp.dtype)
    lo, hi = _span(need)
    if (hi - lo) * size <= staging_bytes:
        return [need]
    out = []
    for first, part in split_region(fp.piece.region(), size, staging_bytes):
        if first + part.numel <= lo or first >= hi:
            continue
        wanting = [t for t in need.targets if transfers(part, t.region, fp.shape)]
        if wanting:
            out.append(_Need(fp, wanting, check=False, stream=need.stream, part=part, part_first=first))
    return out


def _first_element(nd: _Need) -> int:
    """Where in its piece a need starts (for reading a file's needs in order)."""
    return nd.direct_from if nd.direct is not None else nd.part_first


def _span(need: _Need) -> tuple[int, int]:
    """Elements of the piece to read: all of it when checking its CRC, the part for a part's need,
    else what the targets want."""
    fp = need.fp
    n = fp.piece.length // itemsize(fp.dtype)
    if need.check:
        return 0, n
    if need.part is not None:
        return need.part_first, need.part_first + need.part.numel
    region = fp.piece.region()
    lo, hi = n, 0
    for t in need.targets:
        for tr in transfers(region, t.region, fp.shape):
            a, b = element_span(region, fp.shape, tr.box)
            lo, hi = min(lo, a), max(hi, b)
    return (lo, hi) if lo < hi else (0, 0)


def _batches(needs: list[_Need], size: int, batch_bytes: int = BATCH_BYTES) -> list[_Batch]:
    batches = [_Batch()]
    for nd in needs:
        if nd.direct is not None:
            cost = _direct_length(nd)
        else:
            isz = itemsize(nd.fp.dtype)
            lo, hi = _span(nd)
            if hi <= lo:
                continue
            start, end = nd.fp.piece.offset + lo * isz, nd.fp.piece.offset + hi * isz
            nd.first = lo
            nd.read_at = start - start % ALIGN  # aligned: read straight into the staging buffer
            nd.read_len = min(-(-end // ALIGN) * ALIGN, size) - nd.read_at
            nd.skip = start - nd.read_at
            cost = -(-nd.read_len // ALIGN) * ALIGN
        if batches[-1].needs and batches[-1].nbytes + cost > batch_bytes:
            batches.append(_Batch())
        b = batches[-1]
        b.needs.append(nd)
        b.nbytes += cost
        if nd.direct is None:
            b.staging += cost
    return [b for b in batches if b.needs]


def _run(storage: Storage, rel: str, file: str, batches: list[_Batch], index: SourceIndex) -> None:
    """Read up to ``READ_AHEAD`` batches ahead (in threads) while the oldest is checked and copied.

    Staging buffers rotate through ``READ_AHEAD + 1`` slots, so a batch's slot is reused only
    after that batch is finished.
    """
    staging: list[FileBuffer | None] = [None] * (READ_AHEAD + 1)

    def start(k: int) -> tuple[Future, FileBuffer | None, list[int]]:
        batch = batches[k]
        slot_index = k % len(staging)
        buf = staging[slot_index]
        if batch.staging and (buf is None or buf.nbytes < batch.staging):
            buf = staging[slot_index] = (
                index.staging.buffer(batch.staging) if index.staging is not None else FileBuffer(batch.staging)
            )
        ranges, slots, pos = [], [], 0
        for nd in batch.needs:
            if nd.direct is not None:
                ranges.append((nd.fp.piece.offset + nd.direct_from * itemsize(nd.fp.dtype), _direct_bytes(nd)))
                slots.append(-1)
            else:
                assert buf is not None
                ranges.append((nd.read_at, buf.view(nd.read_len, pos)))
                slots.append(pos)
                pos += -(-nd.read_len // ALIGN) * ALIGN
        return pool.submit(storage.read_ranges, rel, ranges), buf, slots

    with ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="ucp-read") as pool:
        pending = [start(k) for k in range(min(READ_AHEAD, len(batches)))]
        try:
            for k, batch in enumerate(batches):
                fut, buf, slots = pending.pop(0)
                fut.result()
                if k + READ_AHEAD < len(batches):
                    pending.append(start(k + READ_AHEAD))
                for nd, slot in zip(batch.needs, slots):
                    _finish(nd, file, buf, slot, index)
        finally:
            for fut, _, _ in pending:
                fut.cancel()
            for fut, _, _ in pending:
                try:
                    fut.result()
                except BaseException:
                    pass


def _finish(nd: _Need, file: str, buf: FileBuffer | None, slot: int, index: SourceIndex) -> None:
    if nd.direct is not None:
        if nd.check:
            check_crc(nd.fp, file, _direct_bytes(nd))
        elif nd.stream:
            index.feed(file, nd.fp, nd.direct_from * itemsize(nd.fp.dtype), _direct_bytes(nd))
    else:
        assert buf is not None
        _finish_staged(nd, file, buf, slot, index)


def _direct_bytes(nd: _Need) -> memoryview:
    """The bytes of the direct target that the piece (or its part) fills."""
    assert nd.direct is not None
    start = nd.direct_at * itemsize(nd.fp.dtype)
    return buffer_bytes(nd.direct.buffer)[start : start + _direct_length(nd)]


def _direct_length(nd: _Need) -> int:
    """Bytes a direct need reads: the whole piece, or its part."""
    return nd.fp.piece.length if nd.direct_count is None else nd.direct_count * itemsize(nd.fp.dtype)


def buffer_bytes(buf: Buffer) -> memoryview:
    """The bytes of a contiguous host buffer (torch tensor, raw or numpy array), no copy."""
    if isinstance(buf, RawArray):
        return buf.data
    if is_numpy(buf):
        import numpy as np

        return buf.reshape(-1).view(np.uint8).data  # memoryview(buf) without numpy's pre-3.12 Buffer typing gap
    from ucp.saving.snapshot import tensor_bytes

    return tensor_bytes(buf)


def _finish_staged(nd: _Need, file: str, buf: FileBuffer, slot: int, index: SourceIndex) -> None:
    """Check a staged piece's CRC (or feed its span to the running one), then copy what each target wants out of it."""
    fp = nd.fp
    isz = itemsize(fp.dtype)
    data_off = slot + nd.skip
    if nd.check:
        check_crc(fp, file, buf.view(fp.piece.length, data_off))
    avail = (nd.read_len - nd.skip) // isz
    if nd.stream:
        index.feed(file, fp, nd.first * isz, buf.view(min(avail * isz, fp.piece.length - nd.first * isz), data_off))
    for t in nd.targets:
        region, first = (fp.piece.region(), nd.first) if nd.part is None else (nd.part, nd.first - nd.part_first)
        copy_region(
            _staged_source(buf, data_off, avail, fp.dtype, t.buffer), region, first, t.buffer, t.region, fp.shape
        )


def _staged_source(buf: FileBuffer, offset: int, count: int, dtype: str, like: Buffer) -> Buffer:
    """``count`` stored elements at ``offset`` of a staging buffer, as the same kind of buffer as ``like``."""
    if isinstance(like, RawArray):
        return RawArray(buf.view(count * like.itemsize, offset), (count,), like.itemsize)
    if is_numpy(like):
        import numpy as np

        return np.frombuffer(buf.view(count * like.itemsize, offset), dtype=like.dtype) if count else like[:0]
    import torch

    torch_type = torch_dtype(dtype)
    return buf.tensor(count * itemsize(dtype), offset).view(torch_type) if count else torch.empty(0, dtype=torch_type)
