"""Filling tensors (or parts of them) from the stored pieces that intersect them: the ``into=`` reads.

For each target (a buffer holding a box or flat range of a logical tensor) the
pieces that intersect it are found with ``reshard.box`` and read:

* straight into the target's memory when the piece holds exactly the target's
  elements in the same order and dtype (a reload with the saved layout);
* otherwise into a staging buffer, then copied (with a dtype cast if needed)
  into every target that wants part of it. When verifying, the whole piece is
  read (its CRC covers all of it); otherwise only the span of it the targets need,
  rounded out to 4 KiB so that the read is O_DIRECT-aligned.

Reads are grouped in batches of about ``BATCH_BYTES``; the next ``READ_AHEAD``
batches are read while batch k is checksummed and copied.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from reshard.box import Box, FlatRange, element_span, transfers

from .dtypes import itemsize, torch_dtype
from .errors import CheckpointError
from .manifest import Manifest
from .reader import FileBuffer, FilePiece, check_crc, check_file_size, pieces_by_file, read_and_check_header
from .regions import Buffer, as_flat_range, copy_region, same_elements
from .storage import Storage

BATCH_BYTES = 128 << 20
READ_AHEAD = 2  # batches in flight while the previous one is checked and copied
ALIGN = 4096


@dataclass
class Target:
    """A tensor (or part of one) to fill: ``buffer`` holds ``region`` of tensor ``name``.

    ``buffer`` is a torch tensor (of any dtype: elements are cast), or a numpy array of the stored
    dtype's item size (``numpy.dtype("V<n>")``: bytes moved as they are, no torch needed).
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
    check: bool = True  # verify this piece's CRC (then it is read whole)
    first: int = 0  # staged: first element of the piece read
    read_at: int = 0  # staged: file offset of the (aligned) read
    read_len: int = 0
    skip: int = 0  # staged: bytes between read_at and the first element


@dataclass
class _Batch:
    needs: list[_Need] = field(default_factory=list)
    staging: int = 0  # bytes of staging buffer the staged needs use
    nbytes: int = 0


def _direct_offset(t: Target, fp: FilePiece) -> int | None:
    """Element offset in ``t.buffer`` where the whole piece can be read straight in, else None.

    That is when the piece's elements form one run of the target's, in order (the same region,
    or both contiguous in the global tensor with the piece inside the target: a row block of a
    whole tensor, a flat ZeRO partition inside a row block...).
    """
    b = t.buffer
    if isinstance(b, np.ndarray):
        if b.itemsize != itemsize(fp.dtype) or not b.flags.c_contiguous or not b.flags.writeable:
            return None
    elif (b.device.type != "cpu" or b.dtype != torch_dtype(fp.dtype) or not b.is_contiguous() or b.requires_grad
          or b.is_conj() or b.is_neg()):  # conjugate/negative views: their memory is not the values
        return None
    region = fp.piece.region()
    if same_elements(t.region, region, fp.shape):
        return 0
    inner, outer = as_flat_range(region, fp.shape), as_flat_range(t.region, fp.shape)
    if inner is None or outer is None or not (outer.start <= inner.start and inner.stop <= outer.stop):
        return None
    return inner.start - outer.start


@dataclass
class SourceIndex:
    """What repeated partial reads of one checkpoint share (e.g. a reshape's many batches).

    The pieces of each tensor with their files, which files' sizes and headers were already
    checked, and which pieces' CRCs are being or have been verified: each piece is claimed for
    verification by the first read that needs it (it reads the piece whole); concurrent and later
    reads take only the span they need. Should the claimer find a bad CRC, its error fails the
    whole operation, so nothing read from that piece is ever committed.
    """

    manifest: Manifest
    files: dict[str, list[FilePiece]]
    by_tensor: dict[str, list[tuple[str, FilePiece]]]
    checked_files: set[str] = field(default_factory=set)
    claimed: set[tuple[str, int]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

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


def read_targets(storage: Storage, name: str, manifest: Manifest, targets: Sequence[Target], *, verify: bool,
                 index: SourceIndex | None = None, staging_bytes: int = BATCH_BYTES) -> None:
    """Fill every target from the pieces that intersect it.

    ``index``: shared across calls on the same checkpoint (see :class:`SourceIndex`); a piece
    another call claimed for verification is not checked again. ``staging_bytes``: reads are grouped
    in batches of about this size; at most ``READ_AHEAD + 1`` batches of staging memory are held
    (a staged piece larger than that is read alone).
    """
    if index is None:
        index = SourceIndex.of(manifest)
    by_tensor: dict[str, list[Target]] = defaultdict(list)
    for t in targets:
        by_tensor[t.name].append(t)
        entry = manifest.tensors.get(t.name)
        if isinstance(t.buffer, np.ndarray) and entry is not None and t.buffer.itemsize != itemsize(entry.dtype):
            raise CheckpointError(f"tensor {t.name!r}: a numpy target of {t.buffer.itemsize}-byte items cannot hold "
                                  f"{entry.dtype} elements ({itemsize(entry.dtype)} bytes; numpy targets are not cast)")
    needs: dict[str, list[_Need]] = defaultdict(list)
    for tensor, wanted in by_tensor.items():
        for file, fp in index.by_tensor.get(tensor, ()):
            region = fp.piece.region()
            wanting = [t for t in wanted if transfers(region, t.region, fp.shape)]
            if wanting:
                at = _direct_offset(wanting[0], fp) if len(wanting) == 1 else None
                check = verify and index.claim(file, fp.piece.offset)
                needs[file].append(_Need(fp, wanting, direct=wanting[0] if at is not None else None,
                                         direct_at=at or 0, check=check))
    for file in sorted(needs):
        file_needs = sorted(needs[file], key=lambda nd: nd.fp.piece.offset)  # sequential reads
        size = manifest.files[file].size
        if file not in index.checked_files:
            check_file_size(storage, name, file, size)
            read_and_check_header(storage, name, file, size, index.files[file])
            index.checked_files.add(file)
        _run(storage, f"{name}/{file}", file, _batches(file_needs, size, staging_bytes))


def _span(need: _Need) -> tuple[int, int]:
    """Elements of the piece to read: all of it when checking its CRC, else what the targets want."""
    fp = need.fp
    n = fp.piece.length // itemsize(fp.dtype)
    if need.check:
        return 0, n
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
            cost = nd.fp.piece.length
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


def _run(storage: Storage, rel: str, file: str, batches: list[_Batch]) -> None:
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
            buf = staging[slot_index] = FileBuffer(batch.staging)
        ranges, slots, pos = [], [], 0
        for nd in batch.needs:
            if nd.direct is not None:
                ranges.append((nd.fp.piece.offset, _direct_bytes(nd)))
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
                    _finish(nd, file, buf, slot)
        finally:
            for fut, _, _ in pending:
                fut.cancel()
            for fut, _, _ in pending:
                try:
                    fut.result()
                except BaseException:
                    pass


def _finish(nd: _Need, file: str, buf: FileBuffer | None, slot: int) -> None:
    if nd.direct is not None:
        if nd.check:
            check_crc(nd.fp, file, _direct_bytes(nd))
    else:
        assert buf is not None
        _finish_staged(nd, file, buf, slot)


def _direct_bytes(nd: _Need) -> memoryview:
    """The bytes of the direct target that the piece fills."""
    assert nd.direct is not None
    start = nd.direct_at * itemsize(nd.fp.dtype)
    return buffer_bytes(nd.direct.buffer)[start:start + nd.fp.piece.length]


def buffer_bytes(buf: Buffer) -> memoryview:
    """The bytes of a contiguous host buffer (torch tensor or numpy array), no copy."""
    if isinstance(buf, np.ndarray):
        return memoryview(buf.reshape(-1).view(np.uint8))
    from .snapshot import tensor_bytes

    return tensor_bytes(buf)


def _finish_staged(nd: _Need, file: str, buf: FileBuffer, slot: int) -> None:
    """Check a staged piece's CRC, then copy what each target wants out of it."""
    fp = nd.fp
    isz = itemsize(fp.dtype)
    data_off = slot + nd.skip
    if nd.check:
        check_crc(fp, file, buf.view(fp.piece.length, data_off))
    avail = (nd.read_len - nd.skip) // isz
    for t in nd.targets:
        copy_region(_staged_source(buf, data_off, avail, fp.dtype, t.buffer), fp.piece.region(), nd.first, t.buffer,
                    t.region, fp.shape)


def _staged_source(buf: FileBuffer, offset: int, count: int, dtype: str, like: Buffer) -> Buffer:
    """``count`` stored elements at ``offset`` of a staging buffer, as the same kind of buffer as ``like``."""
    if isinstance(like, np.ndarray):
        return np.frombuffer(buf.view(count * like.itemsize, offset), dtype=like.dtype) if count else like[:0]
    import torch

    torch_type = torch_dtype(dtype)
    return buf.tensor(count * itemsize(dtype), offset).view(torch_type) if count else torch.empty(0, dtype=torch_type)
