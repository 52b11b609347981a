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

from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from reshard.box import Box, FlatRange, element_span, transfers

from .dtypes import itemsize, torch_dtype
from .manifest import Manifest
from .reader import FileBuffer, FilePiece, check_crc, check_file_size, pieces_by_file, read_and_check_header
from .regions import copy_region, same_elements
from .snapshot import tensor_bytes
from .storage import Storage

BATCH_BYTES = 128 << 20
READ_AHEAD = 2  # batches in flight while the previous one is checked and copied
ALIGN = 4096


@dataclass
class Target:
    """A tensor (or part of one) to fill: ``buffer`` holds ``region`` of tensor ``name``."""

    name: str
    buffer: torch.Tensor
    region: Box | FlatRange
    path: tuple[Any, ...] = ()


@dataclass
class _Need:
    """One stored piece to read, and who wants it."""

    fp: FilePiece
    targets: list[Target]
    direct: Target | None = None  # read straight into this target's memory
    first: int = 0  # staged: first element of the piece read
    read_at: int = 0  # staged: file offset of the (aligned) read
    read_len: int = 0
    skip: int = 0  # staged: bytes between read_at and the first element


@dataclass
class _Batch:
    needs: list[_Need] = field(default_factory=list)
    staging: int = 0  # bytes of staging buffer the staged needs use
    nbytes: int = 0


def _directly_readable(t: Target, fp: FilePiece) -> bool:
    b = t.buffer
    return (b.device.type == "cpu" and b.dtype == torch_dtype(fp.dtype) and b.is_contiguous()
            and not b.requires_grad and same_elements(t.region, fp.piece.region(), fp.shape))


def read_targets(storage: Storage, name: str, manifest: Manifest, targets: Sequence[Target], *, verify: bool) -> None:
    """Fill every target from the pieces that intersect it."""
    by_tensor: dict[str, list[Target]] = defaultdict(list)
    for t in targets:
        by_tensor[t.name].append(t)
    files = pieces_by_file(manifest)
    needs: dict[str, list[_Need]] = defaultdict(list)
    for file, fps in files.items():
        for fp in fps:
            wanting = [t for t in by_tensor.get(fp.tensor, ()) if transfers(fp.piece.region(), t.region, fp.shape)]
            if wanting:
                direct = wanting[0] if len(wanting) == 1 and _directly_readable(wanting[0], fp) else None
                needs[file].append(_Need(fp, wanting, direct))
    for file, file_needs in needs.items():
        size = manifest.files[file].size
        check_file_size(storage, name, file, size)
        read_and_check_header(storage, name, file, size, files[file])
        _run(storage, f"{name}/{file}", file, _batches(file_needs, size, verify), verify)


def _span(need: _Need, verify: bool) -> tuple[int, int]:
    """Elements of the piece to read: all of it when verifying, else what the targets want."""
    fp = need.fp
    n = fp.piece.length // itemsize(fp.dtype)
    if verify:
        return 0, n
    region = fp.piece.region()
    lo, hi = n, 0
    for t in need.targets:
        for tr in transfers(region, t.region, fp.shape):
            a, b = element_span(region, fp.shape, tr.box)
            lo, hi = min(lo, a), max(hi, b)
    return (lo, hi) if lo < hi else (0, 0)


def _batches(needs: list[_Need], size: int, verify: bool) -> list[_Batch]:
    batches = [_Batch()]
    for nd in needs:
        if nd.direct is not None:
            cost = nd.fp.piece.length
        else:
            isz = itemsize(nd.fp.dtype)
            lo, hi = _span(nd, verify)
            if hi <= lo:
                continue
            start, end = nd.fp.piece.offset + lo * isz, nd.fp.piece.offset + hi * isz
            nd.first = lo
            nd.read_at = start - start % ALIGN  # aligned: read straight into the staging buffer
            nd.read_len = min(-(-end // ALIGN) * ALIGN, size) - nd.read_at
            nd.skip = start - nd.read_at
            cost = -(-nd.read_len // ALIGN) * ALIGN
        if batches[-1].needs and batches[-1].nbytes + cost > BATCH_BYTES:
            batches.append(_Batch())
        b = batches[-1]
        b.needs.append(nd)
        b.nbytes += cost
        if nd.direct is None:
            b.staging += cost
    return [b for b in batches if b.needs]


def _run(storage: Storage, rel: str, file: str, batches: list[_Batch], verify: bool) -> None:
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
                ranges.append((nd.fp.piece.offset, tensor_bytes(nd.direct.buffer)))
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
                    _finish(nd, file, buf, slot, verify)
        finally:
            for fut, _, _ in pending:
                fut.cancel()
            for fut, _, _ in pending:
                try:
                    fut.result()
                except BaseException:
                    pass


def _finish(nd: _Need, file: str, buf: FileBuffer | None, slot: int, verify: bool) -> None:
    if nd.direct is not None:
        if verify:
            check_crc(nd.fp, file, tensor_bytes(nd.direct.buffer))
    else:
        assert buf is not None
        _finish_staged(nd, file, buf, slot, verify)


def _finish_staged(nd: _Need, file: str, buf: FileBuffer, slot: int, verify: bool) -> None:
    """Check a staged piece's CRC, then copy what each target wants out of it."""
    fp = nd.fp
    isz = itemsize(fp.dtype)
    data_off = slot + nd.skip
    if verify:
        check_crc(fp, file, buf.view(fp.piece.length, data_off))
    avail = (nd.read_len - nd.skip) // isz
    dtype = torch_dtype(fp.dtype)
    src = buf.tensor(avail * isz, data_off).view(dtype) if avail else torch.empty(0, dtype=dtype)
    for t in nd.targets:
        copy_region(src, fp.piece.region(), nd.first, t.buffer, t.region, fp.shape)
