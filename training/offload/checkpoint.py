"""Offloaded optimizer state as checkpoint state, streamed: never this rank's whole state in memory.

A save hands ``ucp.save`` one :class:`ucp.format.sharding.StreamedShard` per piece of the fp32 masters
and Adam moments, in place of tensors: the writer asks for each piece's bytes as it writes it, and
:class:`TierReader` reads them from the swap files, part by part (a record's master, ``exp_avg`` or
``exp_avg_sq``, checked against its CRC-32C), into a bounded set of reused aligned buffers: the swap
pool's own slots. The pieces are the ones an in-memory run writes (the same regions of the same global
tensors, from :meth:`training.zero.ZeroOptimizer.buffers` on meta tensors), so the checkpoint is an
ordinary one, checksummed like everything else.

A load fills the tier sub-group by sub-group (:func:`fill_tier`): each record, in a slot, is filled from
the stored pieces that intersect it by ``ucp.loading.partial.read_targets`` (so any world size, ZeRO stage
or offload setting that wrote the checkpoint), its masters cast into the compute weights on the way, then
written back to the tier while the next one is filled.

Parameters on NVMe (``offload_param``, ZeRO-3) are streamed the same way: a save's model pieces are
StreamedShards read from the parameters' swap files chunk by chunk through the parameter pool
(:func:`streamed_params`), and a load writes the loaded masters' casts into those files partition by partition
(:meth:`training.offload.params.ParamTier.write_from`): the weights are never staged whole either.

An asynchronous save (``CheckpointManager(async_save=True)``, thread mode) returns while training goes on and
rewrites the swap files, so it streams a *copy* of them: :class:`TierCopy` (and
:class:`training.offload.params.ParamCopy`) copy the files in the kernel (``copy_file_range``; a reflink where
the file system shares extents) on a thread of their own, behind the next forward and backward; the engine
waits for the copies before its next optimizer step writes the tiers (``Engine.wait_snapshot``); the writer
thread reads them part by part into buffers of the reader's own (one pool slot's worth), checked against the
CRCs the records had when copied, and the copies are removed once the save is done. The price is the state's
bytes on the swap device while a save is in flight (none with a reflink) and a copy's I/O there. A
process-mode writer (``mode="process"``) cannot call this process's readers, so each StreamedShard also gives
its bytes as file ranges of the copy (:meth:`TierCopy.ranges`, :meth:`~training.offload.params.ParamCopy.ranges`:
a sub-group's part, or a parameter chunk, with its CRC as copied), asked for once the copy is made: the writer
process reads them itself through ``aio`` into a few reused aligned buffers, checking each block's CRC
(:class:`ucp.store.file_ranges.RangeReader`), so neither process stages the state.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch

from aio.buffers import AlignedBuffer
from aio.config import AioConfig
from aio.engines import Engine, create_engine
from reshard.box import Box, FlatRange, flat_range_to_boxes
from ucp.errors import LayoutMismatchError
from ucp.format.manifest import Manifest
from ucp.format.sharding import FlatShard, Shards, StreamedShard
from ucp.format.tree import dict_items, node_kind, path_str
from ucp.loading.partial import SourceIndex, Target, read_targets
from ucp.saving.snapshot import tensor_bytes
from ucp.store.file_ranges import FileRange
from ucp.store.reader import read_manifest
from ucp.store.storage import Storage, as_aio_config, open_storage

from .errors import OffloadError, os_reason
from .store import FP32, PARTS, NvmeStore, Record, SubGroup, part_crcs
from .swapdir import MIN_ALIGNMENT

if TYPE_CHECKING:
    from training.checkpoint import CheckpointTargets
    from training.zero.optimizer import ZeroOptimizer

    from .optimizer import OptimizerOffload
    from .params import ParamCopy, ParamTier

log = logging.getLogger(__name__)

STATE_KEYS = ("fp32_master", "exp_avg", "exp_avg_sq")  # checkpoint sections, in the order of a record's parts
LOAD_STAGING = 4 << 20  # the loader's staging per batch (it holds a few): small, the records are the big buffers


@dataclass(frozen=True)
class Span:
    """One piece of an offloaded state: elements ``[lo, lo + count)`` of group ``group``'s partition hold
    ``region`` of global tensor ``name`` (in the region's row-major order)."""

    name: str
    group: int
    lo: int
    count: int
    region: Box | FlatRange
    global_shape: tuple[int, ...]
    replica_id: int


def meta_states(optimizer: ZeroOptimizer) -> dict[str, list[torch.Tensor]]:
    """Meta tensors standing for the offloaded states' partitions: ``optimizer.buffers(meta_states(...))``
    gives the layout of the pieces, and where each lies in its partition, without reading the tier."""
    return {key: [torch.empty(plan.size, device="meta") for plan in optimizer.plans] for key in STATE_KEYS}


def meta_params(optimizer: ZeroOptimizer) -> list[torch.Tensor]:
    """Meta tensors standing for stage 3's compute-dtype group partitions (in the parameter tier with
    ``offload_param`` nvme): ``optimizer.buffers(params=meta_params(...))`` lays the model's pieces out
    without staging them."""
    return [torch.empty(plan.size, dtype=optimizer.dtype, device="meta") for plan in optimizer.plans]


def layout(
    optimizer: ZeroOptimizer, shapes: Mapping[str, Sequence[int]], *, states: bool = True, params: bool = False
) -> tuple[dict[str, Any], dict[str, list[Span]]]:
    """This rank's checkpoint pieces without reading a tier: ``({section: {name: piece}}``, and the spans of
    the pieces laid out on meta tensors)``. ``states``: the optimizer states' pieces on meta tensors (to be
    replaced: :func:`streamed_sections`), else live views; ``params``: the model's on meta tensors too, its
    spans under ``"model"`` with a *partition* of the parameter tier as their ``group`` (:func:`streamed_params`),
    else live views."""
    from training.checkpoint import build_targets

    metas = meta_states(optimizer) if states else None
    parts = meta_params(optimizer) if params else None
    targets = build_targets(optimizer.buffers(metas, params=parts), shapes)
    found = spans(targets, metas) if metas is not None else {}
    if parts is not None:
        assert optimizer.param_tier is not None
        found["model"] = [
            _in_partition(optimizer.param_tier, s) for s in spans(targets, {"model": parts}, keys=("model",))["model"]
        ]
    return targets.nested(), found


def _in_partition(tier: ParamTier, s: Span) -> Span:
    """A span of a group's compute-dtype partition as one of the parameter partition holding it."""
    k, off, size = tier.locate(s.group, s.lo)
    if s.lo + s.count > off + size:
        raise RuntimeError(f"model {s.name!r}: a piece across two parameters' partitions")
    return Span(s.name, k, s.lo - off, s.count, s.region, s.global_shape, s.replica_id)


def streamed_params(found: Sequence[Span], tier: ParamTier, copy: ParamCopy | None = None) -> dict[str, Any]:
    """``{name: StreamedShard | Shards}``: the model section of a state dict to save, each piece's bytes read
    from its parameter's swap file chunk by chunk through the tier's pool as the writer asks for them
    (:meth:`ParamOffload.stream`; no write may be in flight nor a read ahead held: :meth:`ParamTier.quiesce`),
    or from ``copy`` of those files (an asynchronous save); ``found``: :func:`layout`'s ``"model"`` spans."""
    off = tier.offload
    stream = copy.stream if copy is not None else off.stream
    by_name: dict[str, list[StreamedShard]] = {}
    for s in found:
        parts = partial(stream, s.group, s.lo, s.lo + s.count)
        phase = s.lo * off.itemsize % MIN_ALIGNMENT if off.swapped(s.group) else None  # chunks: page multiples
        shard = StreamedShard(tier.dtype, s.global_shape, s.region, parts, s.replica_id, phase)
        if copy is not None:  # a writer process reads the copy itself, once it is made
            shard.source = partial(copy.ranges, s.group, s.lo, s.lo + s.count)
            shard.ready = copy.copied
        by_name.setdefault(s.name, []).append(shard)
    return {n: ps[0] if len(ps) == 1 else Shards(ps) for n, ps in by_name.items()}


def spans(
    targets: CheckpointTargets, metas: Mapping[str, Sequence[torch.Tensor]], keys: Sequence[str] = STATE_KEYS
) -> dict[str, list[Span]]:
    """The pieces of each section ``keys`` (the optimizer states) in ``targets`` (built on ``metas``), as spans
    of the partitions."""
    out: dict[str, list[Span]] = {}
    for key in keys:
        groups = {id(t): g for g, t in enumerate(metas[key])}
        found: list[Span] = []
        for name, pieces in targets.sections.get(key, {}).items():
            for p in pieces:
                local = p.local
                g = groups.get(id(local._base if local._base is not None else local))
                if g is None or not local.is_contiguous():
                    raise RuntimeError(f"{key} {name!r}: a piece that is not a contiguous run of a partition")
                region = p.range if isinstance(p, FlatShard) else p.box
                found.append(
                    Span(name, g, int(local.storage_offset()), local.numel(), region, p.global_shape, p.replica_id)
                )
        out[key] = found
    return out


def streamed_sections(spans_by_key: Mapping[str, list[Span]], reader: TierReader) -> dict[str, dict[str, Any]]:
    """``{section: {name: StreamedShard | Shards}}``: the optimizer sections of a state dict to save,
    their bytes read from the tier by ``reader`` as the writer asks for them."""
    out: dict[str, dict[str, Any]] = {}
    for key, found in spans_by_key.items():
        part = STATE_KEYS.index(key)
        by_name: dict[str, list[StreamedShard]] = {}
        for s in found:
            parts = partial(reader.parts, part, s.group, s.lo, s.lo + s.count)
            phase = s.lo * FP32 % MIN_ALIGNMENT  # sub-groups start at page multiples: the parts line up with the file
            shard = StreamedShard(torch.float32, s.global_shape, s.region, parts, s.replica_id, phase)
            if reader.copy is not None:  # a writer process reads the copy itself, once it is made
                shard.source = partial(reader.copy.ranges, part, s.group, s.lo, s.lo + s.count)
                shard.ready = reader.copy.copied
            by_name.setdefault(s.name, []).append(shard)
        out[key] = {n: ps[0] if len(ps) == 1 else Shards(ps) for n, ps in by_name.items()}
    return out


class TierCopy:
    """The NVMe tier's swap files as a save found them, copied on disk, for an asynchronous save that streams
    them on its writer thread while training goes on and rewrites the originals.

    Made on the training thread once the tier is quiet (:meth:`OptimizerOffload.quiesce`: no write-back
    running) with the records' CRC-32Cs as written; the copy (``copy_file_range``: in the kernel, no user
    memory; a reflink where the file system shares extents) runs on a thread of its own, behind the next
    forward and backward, and the tier must not be written before :meth:`wait` (``Engine.wait_snapshot``).
    It costs the state's bytes on the swap device (none with a reflink) until :meth:`close`.
    """

    def __init__(self, offload: OptimizerOffload) -> None:
        offload.quiesce()
        store = offload.store
        if not isinstance(store, NvmeStore):
            raise TypeError("TierCopy copies the swap files of the NVMe tier")
        self.store = store
        self.subgroups = list(offload.subgroups)
        self._crcs = store.crcs()
        self.dir = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=store.dir.path))
        self._paths = {sg.index: self.dir / store.path(sg).name for sg in self.subgroups}
        self.bytes_copied = 0
        pool = ThreadPoolExecutor(1, thread_name_prefix="ucp-offload-copy")
        self.copied: Future[None] = pool.submit(self._copy)
        pool.shutdown(wait=False)

    def _copy(self) -> None:
        for sg in self.subgroups:
            src, dst = self.store.path(sg), self._paths[sg.index]
            if self.store.is_resident(sg):  # no swap file: its record, from memory (the step waits for the copy)
                self._copy_resident(sg, dst)
                continue
            if self._crcs[sg.index] is None:
                raise OffloadError(f"{sg.describe()} has no record in {src}: it was never written whole")
            try:
                self.bytes_copied += copy_file(src, dst)
            except OSError as exc:
                why = os_reason(exc)
                raise OffloadError(
                    f"copying swap file {src} of {sg.describe()} to {dst} for a checkpoint failed: {why}"
                ) from exc

    def _copy_resident(self, sg: SubGroup, dst: Path) -> None:
        """Write resident ``sg``'s record to ``dst`` as its swap file would hold it, its CRCs noted."""
        rec = self.store.resident[sg.index]
        view = rec.buf.view(rec.nbytes)
        self._crcs[sg.index] = part_crcs(view)
        try:
            with open(dst, "wb") as f:
                f.write(view)
        except OSError as exc:
            why = os_reason(exc)
            raise OffloadError(f"writing resident {sg.describe()} to {dst} for a checkpoint failed: {why}") from exc
        self.bytes_copied += rec.nbytes

    def wait(self) -> None:
        """Wait until the copy is made (or failed: the save reports it); the tier may change from then on."""
        _ = self.copied.exception()

    def ranges(self, part: int, group: int, lo: int, hi: int) -> list[FileRange]:
        """Where elements ``[lo, hi)`` of part ``part`` of group ``group``'s partition lie in the copy, each
        sub-group's part a block with the CRC-32C its record had when copied: what a writer process reads
        (:class:`ucp.store.file_ranges.RangeReader`). Waits for the copy, raises its error."""
        self.copied.result()
        out = []
        for sg in self.subgroups:
            a, b = max(lo, sg.lo), min(hi, sg.hi)
            if sg.group != group or a >= b:
                continue
            crcs, stride = self._crcs[sg.index], self.store.stride(sg)
            assert crcs is not None  # checked by the copy
            out.append(
                FileRange(
                    path=str(self._paths[sg.index]),
                    offset=part * stride,
                    length=stride,
                    crc32c=crcs[part],
                    start=(a - sg.lo) * FP32,
                    stop=(b - sg.lo) * FP32,
                    what=f"copy of the swap file of {sg.describe()} for a checkpoint: its {PARTS[part]}",
                    alignment=self.store.alignment,
                )
            )
        return out

    def source(self, sg: SubGroup, engine: Engine) -> tuple[Path, Engine, tuple[int, ...]]:
        """Where to read ``sg``'s record as copied (for :meth:`NvmeStore.read_part`); waits for the copy, raises
        its error."""
        self.copied.result()
        crcs = self._crcs[sg.index]
        assert crcs is not None  # checked by the copy
        return self._paths[sg.index], engine, crcs

    def close(self) -> None:
        """Remove the copy (after the save that reads it is done)."""
        self.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def copy_file(src: Path, dst: Path) -> int:
    """Copy ``src`` to a new file ``dst`` in the kernel: ``copy_file_range`` (a reflink where the file system
    shares extents), else ``sendfile`` through :func:`shutil.copyfile`; no user memory either way. Returns
    the bytes copied."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done)
                if n == 0:
                    break
                done += n
            return done
        except OSError as exc:
            if done or exc.errno not in (errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP):
                raise
    shutil.copyfile(src, dst)
    return os.path.getsize(dst)


class TierReader:
    """Reads runs of the offloaded partitions from the tier for a save, part by part.

    NVMe: each (sub-group, part) is read whole, once, into a buffer carved from the swap pool's slots
    (held for the reader's life; the pool's memory, so a save costs no more than the steps do) and
    checked; an LRU keeps the most recent ones, since the writer asks for the pieces of one part in name
    order, not partition order. CPU tier: views of the resident records, no copy. Use as a context
    manager (the slots go back to the pool at exit).

    ``copy`` (an asynchronous save, training going on): the parts are read from that copy of the swap
    files, with an aio engine of the reader's own, into ``copy_slots`` slots' worth of buffers of its own
    (the steps keep the pool), checked against the CRCs the records had when copied.
    """

    def __init__(self, offload: OptimizerOffload, *, copy: TierCopy | None = None, copy_slots: int = 1) -> None:
        offload.quiesce()  # no write-back still running, no read ahead holding a slot; not broken
        self.offload = offload
        self.store = offload.store
        self.copy = copy
        self._copy_slots = copy_slots
        self._engine: Engine | None = create_engine(copy.store.aio) if copy is not None else None
        self._own: list[AlignedBuffer] = []  # with a copy: its buffers
        self._groups = {g: offload.of_group(g) for g in range(len(offload.sizes))}
        self._records: list[Record] = []  # slots taken from the pool
        self._free: list[memoryview] = []  # one part's worth each, carved from those slots
        self._cache: OrderedDict[tuple[int, int], memoryview] = OrderedDict()
        self.bytes_read = 0
        self.reads = 0
        self.buffer_bytes = 0  # bytes of the pool's slots it took (its buffers)

    def __enter__(self) -> TierReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def parts(self, part: int, group: int, lo: int, hi: int) -> Iterator[memoryview]:
        """The bytes of elements ``[lo, hi)`` of part ``part`` (0 master, 1 exp_avg, 2 exp_avg_sq) of group
        ``group``'s partition, as consecutive views; each view is valid until the next one is asked for."""
        for sg in self._groups[group]:
            a, b = max(lo, sg.lo), min(hi, sg.hi)
            if a >= b:
                continue
            if isinstance(self.store, NvmeStore) and (self.copy is not None or not self.store.is_resident(sg)):
                view = self._part(sg, part)
            else:
                rec = self.store.acquire(sg)
                assert rec is not None
                view = tensor_bytes((rec.master, rec.exp_avg, rec.exp_avg_sq)[part])
            yield view[(a - sg.lo) * FP32 : (b - sg.lo) * FP32]

    def _part(self, sg: SubGroup, part: int) -> memoryview:
        assert isinstance(self.store, NvmeStore)
        key = (sg.index, part)
        view = self._cache.get(key)
        if view is not None:
            self._cache.move_to_end(key)
            return view
        stride = self.store.slot_bytes // len(PARTS)
        if self.copy is not None:
            if not self._free and len(self._own) < self._copy_slots:
                stride = max(self.store.stride(s) for s in self.offload.subgroups)  # resident ones may be larger
                buf = AlignedBuffer(len(PARTS) * stride)
                self._own.append(buf)
                self.buffer_bytes += buf.nbytes
                self._free += [buf.view(stride, k * stride) for k in range(len(PARTS))]
        elif not self._free and len(self._records) < self.store.slots:
            rec = self.store.acquire(sg, block=True)  # every slot is free after settle()
            assert rec is not None
            self._records.append(rec)
            self.buffer_bytes += rec.buf.nbytes
            self._free += [rec.buf.view(stride, k * stride) for k in range(len(PARTS))]
        view = self._free.pop() if self._free else self._cache.popitem(last=False)[1]
        if self.copy is not None:
            assert self._engine is not None
            self.store.read_part(sg, part, view, copy=self.copy.source(sg, self._engine))
        else:
            self.store.read_part(sg, part, view)
        self.bytes_read += self.store.stride(sg)
        self.reads += 1
        self._cache[key] = view
        return view

    def close(self) -> None:
        """Give the slots back to the pool (with a copy: free the buffers, close the engine); idempotent."""
        self._cache.clear()
        self._free.clear()
        self._own.clear()
        records, self._records = self._records, []
        for rec in records:
            self.store.release(rec)
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()


def stored_names(manifest: Manifest, where: str, spans_by_key: Mapping[str, list[Span]]) -> dict[str, dict[str, str]]:
    """The checkpoint's tensor name of each span's ``state_dict["optimizer"][key][name]`` (from the manifest's
    state tree, as a load into tensors finds it). A tensor the checkpoint lacks, or holds in another shape, is a
    LayoutMismatchError naming it, as a load into tensors makes it, before the tier is touched."""
    out: dict[str, dict[str, str]] = {}
    for key, found in spans_by_key.items():
        node = _child(_child(manifest.state, "optimizer"), key)
        names = {} if node is None else {k: _child(node, k) for k, _ in dict_items(node)}
        mine = out.setdefault(key, {})
        for s in found:
            leaf = names.get(s.name)
            path = path_str(("optimizer", key, s.name))
            if not (isinstance(leaf, dict) and node_kind(leaf) == "tensor"):
                raise LayoutMismatchError(f"{where}: the checkpoint lacks {path}")
            entry = manifest.tensors[leaf["tensor"]]
            if tuple(entry.shape) != tuple(s.global_shape):
                raise LayoutMismatchError(
                    f"{where}: {path} (tensor {leaf['tensor']!r}): the checkpoint's shape is {list(entry.shape)}, "
                    f"the engine's {list(s.global_shape)}"
                )
            mine[s.name] = leaf["tensor"]
    return out


def _child(node: Any, key: str) -> Any:
    """The child ``key`` of a dict node of a state tree, else None."""
    if not (isinstance(node, dict) and node_kind(node) in ("dict", "items")):
        return None
    return next((v for k, v in dict_items(node) if k == key), None)


def load_tier(
    offload: OptimizerOffload,
    spans_by_key: Mapping[str, list[Span]],
    path: str | os.PathLike[str],
    *,
    casts: Sequence[torch.Tensor | None],
    aio_config: AioConfig | dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """:func:`fill_tier` from the checkpoint at ``path`` (a directory, or a URL with ``storage_options`` as
    ``ucp.load`` takes them), read through ``aio_config`` (the loader's staging and requests; the default
    is aio's, 8 MiB x 32)."""
    storage, name = open_storage(path, storage_options=storage_options, aio_config=as_aio_config(aio_config))
    with storage:
        return fill_tier(offload, spans_by_key, storage, name, read_manifest(storage, name), casts=casts)


def fill_tier(
    offload: OptimizerOffload,
    spans_by_key: Mapping[str, list[Span]],
    storage: Storage,
    name: str,
    manifest: Manifest,
    *,
    casts: Sequence[torch.Tensor | None],
    verify: bool = True,
    staging_bytes: int = LOAD_STAGING,
) -> int:
    """Fill every sub-group of the tier from the checkpoint ``name`` of ``storage``: a record at a time, in
    a slot, from the stored pieces that intersect it; ``casts[g]`` (the compute-dtype weights of group
    ``g``'s partition, :meth:`~training.zero.ZeroOptimizer.cast_targets`) gets the loaded masters on the
    way. Elements no piece covers (partition padding) are zero. Returns the bytes filled."""
    names = stored_names(manifest, storage.describe(name), spans_by_key)
    index = SourceIndex.of(manifest)
    by_group: dict[int, list[tuple[int, Span]]] = {}
    for k, key in enumerate(STATE_KEYS):
        for s in spans_by_key.get(key, ()):
            by_group.setdefault(s.group, []).append((k, s))
    filled = 0

    def work(sg: SubGroup, rec: Record) -> None:
        nonlocal filled
        parts = (rec.master, rec.exp_avg, rec.exp_avg_sq)
        for t in parts:
            t.zero_()
        targets: list[Target] = []
        for k, s in by_group.get(sg.group, ()):
            a, b = max(s.lo, sg.lo), min(s.lo + s.count, sg.hi)
            if a < b:
                stored = names[STATE_KEYS[k]][s.name]
                targets += _targets(stored, s, parts[k][a - sg.lo : b - sg.lo], a - s.lo, b - s.lo)
        read_targets(storage, name, manifest, targets, verify=verify, index=index, staging_bytes=staging_bytes)
        cast = casts[sg.group]
        if cast is not None:
            cast[sg.lo : sg.hi].copy_(rec.master)
        filled += 3 * sg.numel * FP32

    offload.rewrite(work)
    index.finish(storage, name, staging_bytes)
    return filled


def _targets(stored: str, s: Span, buf: torch.Tensor, first: int, stop: int) -> list[Target]:
    """Load targets (of stored tensor ``stored``) for elements ``[first, stop)`` of span ``s`` (in its region's
    row-major order), held by ``buf``."""
    if isinstance(s.region, FlatRange):
        return [Target(stored, buf, FlatRange(s.region.start + first, s.region.start + stop))]
    out = []
    for at, box in flat_range_to_boxes(first, stop, s.region.shape):
        offsets = tuple(o + b for o, b in zip(s.region.offsets, box.offsets))
        out.append(Target(stored, buf[at - first : at - first + box.numel].view(box.shape), Box(offsets, box.shape)))
    return out


__all__ = [
    "STATE_KEYS",
    "Span",
    "TierCopy",
    "TierReader",
    "copy_file",
    "stored_names",
    "fill_tier",
    "layout",
    "load_tier",
    "meta_params",
    "meta_states",
    "streamed_params",
    "spans",
    "streamed_sections",
]
