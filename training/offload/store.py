"""Where optimizer sub-groups live between steps: swap files through ``aio`` (NVMe tier) or host memory (CPU tier).

A *sub-group* is a run of at most ``sub_group_size`` elements of one ZeRO group's partition on this
rank. Its *record* is three fp32 tensors (master, exp_avg, exp_avg_sq), each padded to the I/O
alignment, back to back: one swap file per sub-group, read and written whole.

:class:`NvmeStore` keeps records in swap files (O_DIRECT where the file system allows, preallocated
so a full device fails at start-up, not mid-run) and lends out *slots*: page-aligned, pre-faulted
buffers of one record each, from a pool whose size is a byte budget. Every write records the
record's CRC-32C; every read checks it, and checks that the whole record came back, so a swap file
truncated or changed under the run is an :class:`OffloadError` naming the file and the sub-group,
never silent garbage. :class:`HostStore` keeps each record resident in its own aligned buffer
(pinned where a GPU exists); its reads and writes are no-ops.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import crc32c
import torch

from aio.buffers import AlignedBuffer, round_up
from aio.config import AioConfig
from aio.engines import Engine, create_engine
from aio.errors import AioError, is_no_space
from aio.files import open_file, preallocate
from aio.sizes import format_size
from aio.transfer import transfer

from .errors import OffloadError
from .swapdir import SwapDir

FP32 = 4
PIPELINE_SLOTS = 2  # slots the pool keeps when spare budget holds resident sub-groups: one read ahead, one in use
# The NVMe tier's slots and resident records on transparent huge pages (aio.buffers.AlignedBuffer): O_DIRECT pins
# 2 MiB pages per request instead of 512 small ones. Measured on gpt-100m (docs/benchmarks.md): the process's system
# time per step 0.20 -> 0.02 CPU-s. The CPU tier's records move no bytes and measured no gain: ordinary pages.
HUGE_PAGES = True
PARTS = ("master", "exp_avg", "exp_avg_sq")  # a record's tensors, in file order


@dataclass(frozen=True)
class SubGroup:
    """Elements ``[lo, hi)`` of ZeRO group ``group``'s partition; ``index``: its place in the step order."""

    index: int
    group: int
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def describe(self) -> str:
        return f"sub-group {self.index} (group {self.group}, elements [{self.lo}, {self.hi}))"


def split(sizes: Sequence[int], sub_group_size: int, quantum: int) -> list[SubGroup]:
    """Cut each group's partition (``sizes[g]`` elements) into sub-groups of ``sub_group_size`` elements,
    rounded down to a multiple of ``quantum`` (at least one quantum), the last of each group shorter."""
    step = max(quantum, sub_group_size // quantum * quantum)
    out: list[SubGroup] = []
    for g, n in enumerate(sizes):
        for lo in range(0, n, step):
            out.append(SubGroup(len(out), g, lo, min(n, lo + step)))
    return out


class Record:
    """Views of one record (master, exp_avg, exp_avg_sq) in a buffer laid out for ``numel`` elements."""

    def __init__(self, buf: AlignedBuffer, numel: int, stride: int, *, resident: bool = False) -> None:
        self.buf = buf
        self.resident = resident  # a resident sub-group's own buffer (NvmeStore), never a pool slot
        whole = buf.tensor(3 * stride)
        self.nbytes = 3 * stride
        self.master, self.exp_avg, self.exp_avg_sq = (
            whole[i * stride : i * stride + numel * FP32].view(torch.float32) for i in range(3)
        )


def part_crcs(view: memoryview) -> tuple[int, ...]:
    """The CRC-32C of each of a record's :data:`PARTS`, each checksummed alone (a checkpoint reads one part)."""
    stride = view.nbytes // len(PARTS)
    return tuple(crc32c.crc32c(view[k * stride : (k + 1) * stride]) for k in range(len(PARTS)))


class HostStore:
    """The CPU tier: every record resident in host memory (pinned where a GPU exists and ``pin``)."""

    kind = "cpu"

    def __init__(self, subgroups: Sequence[SubGroup], *, pin: bool, alignment: int = 4096) -> None:
        self.subgroups = list(subgroups)
        self.alignment = alignment
        self.pinned = bool(pin)  # page-locked host buffers (only where a GPU exists)
        self._records: list[Record] = []
        for sg in self.subgroups:
            stride = round_up(sg.numel * FP32, alignment)
            self._records.append(Record(AlignedBuffer(3 * stride, pin=pin if pin else False), sg.numel, stride))
        self.bytes_read = self.bytes_written = 0
        self.read_seconds = self.write_seconds = 0.0

    @property
    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self._records)

    def is_resident(self, sg: SubGroup) -> bool:
        return True

    def acquire(self, sg: SubGroup, block: bool = True) -> Record | None:
        return self._records[sg.index]

    def read(self, sg: SubGroup, rec: Record) -> None:
        return None

    def write(self, sg: SubGroup, rec: Record) -> None:
        return None

    def release(self, rec: Record) -> None:
        return None

    def close(self) -> None:
        self._records.clear()


class NvmeStore:
    """The NVMe tier: a swap file per sub-group in ``swap_dir``, slots from a pool of at most ``slots``
    buffers of one (largest) record each; ``budget`` (bytes) caps the pool further.

    ``read``/``write`` block until the bytes moved (call them from I/O threads to overlap); each request
    is at most ``aio.block_size`` bytes and ``aio.queue_depth`` are in flight.
    """

    kind = "nvme"

    def __init__(
        self,
        subgroups: Sequence[SubGroup],
        swap_dir: SwapDir,
        aio: AioConfig,
        *,
        slots: int,
        budget: int | None = None,
        pin: bool = False,
        ratio: float = 1.0,
        keep_resident: bool = False,
    ) -> None:
        self.subgroups = list(subgroups)
        self.dir = swap_dir
        self.alignment = swap_dir.alignment
        self.budget = budget
        self._pin = pin
        self.pinned = bool(pin)  # page-locked slots (only where a GPU exists)
        self.resident: dict[int, Record] = {}  # sub-group index -> its record, kept in host memory (never swapped)
        chosen = self._plan(slots, ratio, keep_resident)
        for sg in self.subgroups:
            if sg.index in chosen:
                stride = self.stride(sg)
                buf = AlignedBuffer(3 * stride, pin=pin if pin else False, huge=HUGE_PAGES)
                self.resident[sg.index] = Record(buf, sg.numel, stride, resident=True)
        self.swapped = [sg for sg in self.subgroups if sg.index not in self.resident]
        self.aio = aio.model_copy(update={"alignment": self.alignment}) if aio.alignment != self.alignment else aio
        self.block = max(self.alignment, self.aio.block_size // self.alignment * self.alignment)
        self._engine = create_engine(self.aio)
        self._free: list[AlignedBuffer] = []
        self._created = 0
        self._cond = threading.Condition()
        self._crc: list[tuple[int, ...] | None] = [None] * len(self.subgroups)  # one per part (PARTS)
        # Files are opened per transfer, not held: a large model has more sub-groups than a process has descriptors.
        self._paths = [swap_dir.file(f"subgroup-{sg.index:05d}-g{sg.group}.swp") for sg in self.subgroups]
        self.bytes_read = self.bytes_written = 0
        self.read_seconds = self.write_seconds = 0.0  # time the I/O threads spent moving and checking records
        self._count = threading.Lock()
        try:
            for sg in self.swapped:
                with open_file(self._paths[sg.index], "w", direct=self.aio.use_direct) as f:
                    preallocate(f, self.record_bytes(sg))
        except AioError as exc:
            self.close()
            raise self._io_error("reserving space for", sg, exc) from exc
        except BaseException:
            self.close()
            raise

    # -- layout ------------------------------------------------------------------------------
    def _plan(self, slots: int, ratio: float, keep_resident: bool) -> set[int]:
        """Size the pool (:attr:`slots`, :attr:`slot_bytes`) and choose the resident sub-groups (indices).

        ``ratio`` (DeepSpeed's ``offload_optimizer.ratio``): at most that fraction of the sub-groups is swapped;
        the rest are resident whatever the budget. ``keep_resident`` with a budget: the pool keeps at most
        :data:`PIPELINE_SLOTS` slots and what the budget holds beyond them keeps more sub-groups resident. Either
        way the resident sub-groups are the first in index order (the first parameters: backward hands their
        gradients over last, so the end of a step needs no I/O), and the pool's slots fit the largest swapped
        record. Everything resident counts against the budget."""
        n = len(self.subgroups)
        forced = n - math.floor(ratio * n + 1e-9)  # sub-groups the ratio keeps out of the swap files
        chosen = {sg.index for sg in self.subgroups[:forced]}
        held = sum(self.record_bytes(sg) for sg in self.subgroups[:forced])
        budget = self.budget
        if budget is not None and keep_resident:
            slots = min(slots, PIPELINE_SLOTS)
        rest = self.subgroups[forced:]
        while True:
            largest = max((sg.numel for sg in rest), default=0)
            self.slot_bytes = 3 * round_up(largest * FP32, self.alignment)
            if budget is None or not rest:
                self.slots = max(1, slots) if rest else 0
                return chosen
            if held + self.slot_bytes > budget:
                kept = (
                    f"the {forced} sub-groups ratio {ratio} keeps resident ({format_size(held)}) and " if held else ""
                )
                raise OffloadError(
                    f"swap_budget {format_size(budget)} holds not {kept}one sub-group's state "
                    f"({format_size(self.slot_bytes)} for {largest} elements): lower sub_group_size"
                    f"{', raise ratio' if held else ''} or raise the budget"
                )
            self.slots = max(1, min(slots, (budget - held) // self.slot_bytes))
            if not keep_resident or len(rest) <= 1:
                return chosen
            first = rest[0]  # keep it resident if the slots (for what would then be swapped) still fit beside it
            after = rest[1:]
            slot_after = 3 * round_up(max(sg.numel for sg in after) * FP32, self.alignment)
            if held + self.record_bytes(first) + self.slots * slot_after > budget:
                return chosen
            chosen.add(first.index)
            held += self.record_bytes(first)
            rest = after

    def stride(self, sg: SubGroup) -> int:
        return round_up(sg.numel * FP32, self.alignment)

    def record_bytes(self, sg: SubGroup) -> int:
        return 3 * self.stride(sg)

    def path(self, sg: SubGroup) -> Path:
        return self._paths[sg.index]

    @property
    def pool_bytes(self) -> int:
        """Bytes of the slots made so far (at most ``slots × slot_bytes``)."""
        return self._created * self.slot_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes of the resident sub-groups' records (host memory, counted against the budget)."""
        return sum(rec.buf.capacity for rec in self.resident.values())

    def is_resident(self, sg: SubGroup) -> bool:
        """Whether ``sg`` stays in host memory (no swap file; its reads and writes are no-ops)."""
        return sg.index in self.resident

    # -- slots -------------------------------------------------------------------------------
    def acquire(self, sg: SubGroup, block: bool = True) -> Record | None:
        """A slot laid out for ``sg``; None when ``block`` is False and every slot is lent out. A resident
        sub-group's own record (no slot)."""
        if sg.index in self.resident:
            return self.resident[sg.index]
        with self._cond:
            while not self._free and self._created >= self.slots:
                if not block:
                    return None
                self._cond.wait()
            if self._free:
                buf = self._free.pop()
            else:
                self._created += 1
                buf = None
        if buf is None:
            buf = AlignedBuffer(self.slot_bytes, pin=self._pin if self._pin else False, huge=HUGE_PAGES)
        return Record(buf, sg.numel, self.stride(sg))

    def release(self, rec: Record) -> None:
        if rec.resident:
            return
        with self._cond:
            self._free.append(rec.buf)
            self._cond.notify()

    # -- moving records ----------------------------------------------------------------------
    def write(self, sg: SubGroup, rec: Record) -> None:
        """Write ``rec`` as ``sg``'s swap file (CRC-32C noted for the next read); a resident one stays put."""
        if rec.resident:
            return
        t0 = time.perf_counter()
        view = rec.buf.view(rec.nbytes)
        self._crc[sg.index] = part_crcs(view)
        try:
            error = transfer(
                self._engine, self._paths[sg.index], view, write=True, block=self.block, direct=self.aio.use_direct
            )[0]
        except AioError as exc:  # opening it (the file was removed under the run)
            error = exc
        if error is not None:
            self._crc[sg.index] = None
            raise self._io_error("writing", sg, error) from error
        with self._count:
            self.bytes_written += rec.nbytes
            self.write_seconds += time.perf_counter() - t0

    def read(self, sg: SubGroup, rec: Record) -> None:
        """Fill ``rec`` from ``sg``'s swap file and check it is whole and unchanged (resident: nothing to do)."""
        if rec.resident:
            return
        self._read(sg, rec.buf.view(rec.nbytes), 0, len(PARTS))

    def read_part(
        self, sg: SubGroup, part: int, into: memoryview, *, copy: tuple[Path, Engine, tuple[int, ...]] | None = None
    ) -> None:
        """Fill ``into`` (aligned, at least :meth:`stride` bytes) with part ``part`` of ``sg``'s record (an index
        of :data:`PARTS`, padded to the stride), checked like :meth:`read`: a checkpoint reads only the part
        it writes (training.offload.checkpoint). ``copy``: read it from a copy of the swap file instead
        ``(its path, the engine to read it with, the record's CRCs as copied)``; not counted in the tier's figures.
        A resident sub-group's part (no ``copy``) is copied from its record."""
        if copy is None and sg.index in self.resident:
            n = self.stride(sg)
            into[:n] = self.resident[sg.index].buf.view(n, part * n)
            return
        self._read(sg, into[: self.stride(sg)], part, part + 1, copy=copy)

    def crcs(self) -> list[tuple[int, ...] | None]:
        """Each sub-group's CRC-32C per part as last written (None: never written whole, or resident): what a copy
        of the swap files is checked against."""
        return list(self._crc)

    def _read(
        self,
        sg: SubGroup,
        view: memoryview,
        first: int,
        stop: int,
        *,
        copy: tuple[Path, Engine, tuple[int, ...]] | None = None,
    ) -> None:
        """Read parts ``[first, stop)`` of ``sg``'s record into ``view``; check it came back whole and each
        part's CRC-32C."""
        t0 = time.perf_counter()
        expected = self._crc[sg.index] if copy is None else copy[2]
        if expected is None:
            raise OffloadError(f"{sg.describe()} has no record in {self.path(sg)}: it was never written whole")
        stride = self.stride(sg)
        path = self._paths[sg.index] if copy is None else copy[0]
        try:
            error, whole, size = transfer(
                self._engine if copy is None else copy[1],
                path,
                view,
                write=False,
                block=self.block,
                direct=self.aio.use_direct,
                offset=first * stride,
            )
        except AioError as exc:  # opening it (the file was removed under the run)
            raise self._io_error("reading", sg, exc, path) from exc
        if error is not None:
            raise self._io_error("reading", sg, error, path) from error
        what = "swap file" if copy is None else "copy of the swap file"
        if not whole:
            raise OffloadError(
                f"{what} {path} of {sg.describe()} is truncated: {size} bytes, its record needs "
                f"{self.record_bytes(sg)} (changed under the run; the optimizer state is lost)"
            )
        for k in range(first, stop):
            got = crc32c.crc32c(view[(k - first) * stride : (k - first + 1) * stride])
            if got != expected[k]:
                raise OffloadError(
                    f"{what} {path} of {sg.describe()} is corrupt: CRC-32C {got:#010x} of its {PARTS[k]}, "
                    f"written as {expected[k]:#010x} (changed under the run; the optimizer state is lost)"
                )
        if copy is not None:
            return
        with self._count:
            self.bytes_read += view.nbytes
            self.read_seconds += time.perf_counter() - t0

    def _io_error(self, doing: str, sg: SubGroup, exc: BaseException, path: Path | None = None) -> OffloadError:
        path = getattr(exc, "filename", None) or path or self.path(sg)
        if is_no_space(exc):
            why = f"the device is full ({os.strerror(exc.errno or 28)})"  # type: ignore[attr-defined]
        else:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return OffloadError(f"{doing} swap file {path} of {sg.describe()} failed: {why}")

    def close(self) -> None:
        """Close the engine, free the slots and the resident records (the directory is the owner's to remove)."""
        self._engine.close()
        with self._cond:
            self._free.clear()
        self.resident.clear()
