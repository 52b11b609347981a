"""``ucp.conversion.reshape``: rewrite a checkpoint for another layout (or consolidated), streaming.

Loading already reshards (``ucp.load(path, into=...)`` reads any layout into any other), so a
reshape is never *needed*; it is worth doing when one layout will be loaded many times: after
it, each target rank finds everything it saves in one file, in the order of its buffers, and
reads it in one sequential pass. With no target layout the checkpoint is *consolidated*: one
piece per tensor, in one file.

How it runs, per target file (the files of several ranks in parallel, ``workers``):

1. the file is planned like a save by that rank would plan it (:func:`ucp.saving.plan.make_plan`);
2. its pieces are filled in batches, each piece straight from the source bytes that intersect
   it (:func:`ucp.loading.partial.read_targets`), the next two batches being read while one is written;
3. the batch is written through the same file writer and on-the-way-out CRC-32C as a save, except
   that a piece copying one stored piece whole keeps that piece's CRC, which its read checked
   (:func:`copied_crcs`): each byte is checksummed once;
4. at the end the manifest is built and checked like a save's and committed atomically.

Memory: the budget is shared by the files written at once, each holding ``BATCHES_HELD``
batches' worth (batches in flight and their read staging); pieces larger than a batch are
read and written part by part (see :func:`reshape`).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from pydantic import BaseModel

from reshard import Box, FlatRange, Layout
from reshard.box import split_region, transfers
from ucp.conversion.placement import Placement, SectionKind, layout_metadata, param_shapes, place, recorded_layout
from ucp.errors import DestinationError
from ucp.format.dtypes import itemsize
from ucp.format.manifest import Manifest, now_utc
from ucp.format.regions import RawArray, same_elements
from ucp.loading.partial import READ_AHEAD as STAGED_READ_AHEAD
from ucp.loading.partial import SourceIndex, Target, read_targets
from ucp.saving.plan import DIRECT_MIN_BYTES, LeafLayout, PlannedPiece, SavePlan, make_plan
from ucp.store import commit as _commit
from ucp.store.reader import MemoryPool, check_data_files, read_manifest
from ucp.store.storage import Storage, open_storage
from ucp.store.writer import PieceBytes, write_rank_file

DEFAULT_MEMORY_BUDGET = 384 << 20
MIN_MEMORY_BUDGET = 1 << 20  # the smallest memory budget reshape accepts
READ_AHEAD = 2  # batches of a file being read while the previous one is written
STAGING_SHARE = 4  # a batch's reads are staged a quarter batch at a time ...
STAGING_SLOTS = STAGED_READ_AHEAD + 1  # ... in the slots read_targets rotates through
# Memory per file written at once, in batches: READ_AHEAD batches being read, the one being
# written and the one before it (the writer lets go of a batch only once it has moved on: it
# keeps the last views it was given, and its requests in flight read them), plus the read
# staging of the READ_AHEAD fills in progress (STAGING_SLOTS / STAGING_SHARE of a batch each).
BATCHES_HELD = READ_AHEAD + 2 + READ_AHEAD * STAGING_SLOTS / STAGING_SHARE
PAGE = 4096
# The smallest batch: what the smallest budget gives one file. A smaller budget per file would
# mean batches not worth their round of reads and writes, so fewer files are written at once.
MIN_BATCH_BYTES = int(MIN_MEMORY_BUDGET / BATCHES_HELD) // PAGE * PAGE
Progress = Callable[[int, int, str], None]


class ReshapeReport(BaseModel):
    """What a reshape did (``ucp reshape --json`` prints it)."""

    src: str
    dst: str
    world_size: int
    mesh: dict[str, int] | None
    zero_stage: int | None
    files: int
    tensors: int
    bytes_written: int
    seconds: float
    memory_budget: int  # bytes of data buffers it was allowed to hold


@dataclass(frozen=True)
class _Chunk:
    """What one fill reads for the writer: a whole planned piece, or one part of a piece larger than a batch."""

    index: int  # of the piece in its plan
    piece: PlannedPiece
    region: Box | FlatRange  # the part's elements (the piece's region when whole)
    at: int  # byte offset of the part in the piece
    length: int

    @property
    def whole(self) -> bool:
        return self.length == self.piece.length

    @property
    def phase(self) -> int:
        """Where the part's memory starts within a page: in phase with its file offset, so that
        the writer moves large parts straight from it with O_DIRECT."""
        return (self.piece.offset + self.at) % PAGE if self.piece.length >= DIRECT_MIN_BYTES else 0

    @property
    def slot(self) -> int:
        return _slot(self.phase + self.length)


@dataclass
class _Job:
    plan: SavePlan
    batches: list[list[_Chunk]]


def reshape(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    layout: Layout | None = None,
    shapes: dict[str, Sequence[int]] | None = None,
    sections: dict[str, SectionKind] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    workers: int = 2,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ReshapeReport:
    """Write checkpoint ``src`` again at ``dst``, laid out as ``layout`` (None: consolidated).

    ``shapes`` (parameter name -> shape, in ZeRO flattening order) and ``sections`` default to
    what ``src`` recorded (see :mod:`ucp.conversion.placement`); without a record, the shapes are read off
    the checkpoint's weights. ``dst`` must not exist unless ``overwrite`` (then it must be a
    checkpoint, replaced atomically). ``progress(done, total, tensor)`` is called as piece bytes
    are written (``total``: all of them; headers and padding are not counted).

    Memory: ``memory_budget`` bounds the data buffers (the batches being read and written, and
    their read staging). It is shared by the files written at once, each holding ``BATCHES_HELD``
    batches' worth: ``READ_AHEAD`` batches being read, the one being written, the one before it
    (the writer has not let go of it yet) and the read staging of the fills in progress. A budget
    too small for ``workers`` files of ``MIN_BATCH_BYTES`` batches writes fewer files at once (one
    at the 1 MiB minimum). A piece larger than a batch is read and written part by part (row slabs
    of a box, sub-ranges of a flat range: :func:`reshard.box.split_region`), and a source piece
    that only partly fits the staging is read span by span, its CRC checked as the spans arrive in
    order (:class:`ucp.loading.partial.SourceIndex`), so tensor size does not raise the peak. A staged
    source span larger than the staging (a part of a column split cuts source rows wider than
    itself) is read in parts of the staging's size too, and what no span brought in order is read
    at the end (:meth:`ucp.loading.partial.SourceIndex.finish`), a staging's worth at a time.
    Not counted: the destination writer's requests in flight (up to ``queue_depth`` x
    ``block_size`` of the storage's :class:`aio.AioConfig` per file: its own staging blocks or, for
    large aligned pieces, memory of batches already handed over, freed as the writes complete).
    """
    started = time.perf_counter()
    src_storage, src_name = open_storage(src)
    with src_storage:
        manifest = read_manifest(src_storage, src_name)
        check_data_files(src_storage, src_name, manifest)  # before output is planned and preallocated from its claims
        per_rank, metadata, mesh = _targets(manifest, layout, shapes, sections, src)
        source = Source(src_storage, src_name, manifest)
        new, plans = rewrite(
            source,
            dst,
            per_rank,
            metadata=metadata,
            mesh=mesh,
            memory_budget=memory_budget,
            workers=workers,
            overwrite=overwrite,
            progress=progress,
        )
    return ReshapeReport(
        src=os.fspath(src),
        dst=os.fspath(dst),
        world_size=len(per_rank),
        mesh=mesh,
        zero_stage=None if layout is None else layout.zero.stage,
        files=sum(p.file is not None for p in plans),
        tensors=len(new.tensors),
        bytes_written=sum(p.file_size for p in plans),
        seconds=time.perf_counter() - started,
        memory_budget=memory_budget,
    )


@dataclass
class Source:
    """What a rewrite reads: the files a manifest describes, in ``storage`` under ``name``.

    ``verify``: check each piece's CRC-32C as it is read. A source that is not a UCP checkpoint
    (an importer's description of foreign files, whose pieces carry no CRCs and whose files no
    safetensors header) passes ``verify=False``.
    """

    storage: Storage
    name: str
    manifest: Manifest
    verify: bool = True
    index: SourceIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = SourceIndex.of(self.manifest)
        if not self.verify:  # nothing of theirs to check: sizes are the describer's, headers do not exist
            self.index.checked_files.update(self.manifest.files)


def consolidated(manifest: Manifest) -> list[list[LeafLayout]]:
    """The one target rank of a consolidated copy: every tensor whole, one piece each."""
    return [
        [
            LeafLayout(n, e.dtype, tuple(e.shape), Box.full(tuple(e.shape)), 0, False, _phase(e.nbytes))
            for n, e in manifest.tensors.items()
        ]
    ]


def rewrite(
    source: Source,
    dst: str | os.PathLike[str],
    per_rank: list[list[LeafLayout]],
    *,
    metadata: dict[str, Any],
    mesh: dict[str, int] | None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    workers: int = 2,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> tuple[Manifest, list[SavePlan]]:
    """Write ``source``'s tensors at ``dst`` as ``per_rank`` lays them out (leaf layouts per target rank),
    and commit it with ``metadata``; the new manifest and the target ranks' plans. See :func:`reshape`
    for ``memory_budget``, ``workers``, ``overwrite`` and ``progress``."""
    if memory_budget < MIN_MEMORY_BUDGET:
        raise ValueError(f"memory budget {memory_budget} bytes is below the 1 MiB minimum")
    dst_storage, dst_name = open_storage(dst)
    with dst_storage:
        if dst_storage.exists(dst_name) and not overwrite:
            raise DestinationError(
                f"{dst_storage.describe(dst_name)} already exists (pass overwrite=True, or --overwrite, to replace it)"
            )
        if dst_storage.exists(dst_name):
            _commit.check_replaceable(dst_storage, dst_name)
        world = len(per_rank)
        plans = [make_plan(layouts, r, world) for r, layouts in enumerate(per_rank)]
        files_at_once, batch_bytes = _share_budget(memory_budget, workers, sum(p.file is not None for p in plans))
        jobs = [_Job(p, _batches(p, batch_bytes)) for p in plans if p.file is not None]
        # Staged spans are cut to `staging` bytes and read from page boundaries (up to a page more at
        # each end), so each staging buffer fits the pool's share of a batch.
        # Each pool is capped at the mappings BATCHES_HELD counts, so memory a lagging thread still
        # views is waited for rather than doubled (see MemoryPool); the staging size is whole pages,
        # as the mappings are.
        staging_size = batch_bytes // STAGING_SHARE // PAGE * PAGE
        staging = staging_size - 2 * PAGE
        stop = threading.Event()  # a Ctrl-C (or a failed file) must not leave the other files being written
        source.index.staging = MemoryPool(staging_size, limit=files_at_once * READ_AHEAD * STAGING_SLOTS, abandon=stop)
        arenas = MemoryPool(batch_bytes, limit=files_at_once * (READ_AHEAD + 2), abandon=stop)
        advance = _progress_counter(sum(p.length for plan in plans for p in plan.pieces), progress)
        temp = _commit.make_temp_dir(dst_storage, dst_name)
        lock_fd = _commit.lock_temp(dst_storage, temp)  # a save in flight, not a leftover to clean
        try:
            reports = _write_files(
                jobs, plans, source, arenas, dst_storage, temp, files_at_once, staging, advance, stop
            )
            source.index.finish(source.storage, source.name, staging)  # CRCs of sources read span by span
            new = _commit.build_manifest(
                reports, world_size=world, step=source.manifest.step, metadata=metadata, mesh=mesh, created=now_utc()
            )
            _commit.commit(dst_storage, temp, dst_name, new)
        except BaseException:
            _commit.abort(dst_storage, temp)
            raise
        finally:
            _commit.close_fd(lock_fd)
    return new, plans


def _share_budget(memory_budget: int, workers: int, files: int) -> tuple[int, int]:
    """How many files to write at once, and the batch size that keeps them within the budget.

    Each file written at once holds ``BATCHES_HELD`` batches. A budget too small for ``workers``
    files with batches of at least ``MIN_BATCH_BYTES`` writes fewer files at once (one at the
    minimum budget) rather than exceed it.
    """
    affordable = int(memory_budget // (BATCHES_HELD * MIN_BATCH_BYTES))
    at_once = max(1, min(workers, files, affordable))
    return at_once, int(memory_budget / (BATCHES_HELD * at_once)) // PAGE * PAGE


def _progress_counter(total: int, progress: Progress | None) -> Callable[[int, str], None]:
    """``advance(n, tensor)``: n more piece bytes written; called from the writer threads."""
    done = 0
    lock = threading.Lock()

    def advance(n: int, what: str) -> None:
        nonlocal done
        with lock:  # also keeps the reported counts in order
            done += n
            if progress is not None:
                progress(done, total, what)

    return advance


# -- what each target rank writes ----------------------------------------------------------------


def _targets(
    manifest: Manifest,
    layout: Layout | None,
    shapes: Mapping[str, Sequence[int]] | None,
    sections: dict[str, SectionKind] | None,
    src: Any,
) -> tuple[list[list[LeafLayout]], dict[str, Any], dict[str, int] | None]:
    """Per target rank the leaf layouts to plan, the new metadata and the mesh."""
    metadata = dict(manifest.metadata)
    source = {"path": os.fspath(src), "world_size": manifest.topology.world_size, "mesh": manifest.topology.mesh}
    metadata["reshaped_from"] = source
    if layout is None:  # consolidated: one rank, one piece per tensor; no layout needed
        return consolidated(manifest), _consolidated_metadata(metadata), None
    recorded = recorded_layout(manifest, source=f"{os.fspath(src)}/manifest.json")
    sections = dict(sections or recorded.sections)
    if shapes is None:
        shapes = recorded.shapes if recorded.shapes is not None else param_shapes(manifest, sections)
    placements = place(manifest, layout, shapes, sections)
    whole = [
        LeafLayout(
            n,
            manifest.tensors[n].dtype,
            tuple(manifest.tensors[n].shape),
            Box.full(tuple(manifest.tensors[n].shape)),
            0,
            True,
            _phase(manifest.tensors[n].nbytes),
        )
        for n in placements.whole
    ]
    per_rank = [_rank_layouts(manifest, mine) + whole for mine in placements.ranks]
    mesh = {"tp": layout.mesh.tp, "pp": layout.mesh.pp, "dp": layout.mesh.dp}
    metadata.update(layout_metadata(layout, shapes, sections))
    metadata.update({"mesh": mesh, "zero_stage": layout.zero.stage, "consolidated": False})
    return per_rank, metadata, mesh


def _consolidated_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """The source's metadata for its consolidated copy.

    A recorded layout (``metadata.layout``) is rewritten for one rank: mesh 1, ZeRO-0, contiguous
    pipeline stages (explicit ``stages`` name more stages than pp=1 has). A ``layout`` value that is
    not a layout is someone else's metadata: kept as it is, like every other key but the
    conventional ``mesh``, ``zero_stage`` and ``consolidated``.
    """
    try:
        base = Layout.model_validate(metadata["layout"]) if metadata.get("layout") is not None else None
    except ValueError:  # pydantic's ValidationError included
        base = None
    if base is not None:
        metadata["layout"] = base.replace(
            mesh=base.mesh.model_copy(update={"tp": 1, "pp": 1, "dp": 1, "ep": 1}),
            zero=base.zero.model_copy(update={"stage": 0}),
            pipeline=base.pipeline.model_copy(update={"stages": None}),
        ).model_dump(mode="json")
    metadata.update({"mesh": {"tp": 1, "pp": 1, "dp": 1}, "zero_stage": 0, "consolidated": True})
    return metadata


def _phase(nbytes: int) -> int | None:
    """Large pieces are filled in page-aligned memory and placed at page-aligned file offsets (zero-copy writes)."""
    return 0 if nbytes >= DIRECT_MIN_BYTES else None


def _rank_layouts(manifest: Manifest, mine: list[Placement]) -> list[LeafLayout]:
    """One leaf per tensor; a tensor with several regions on the rank becomes consecutive parts 0, 1, ..."""
    by_tensor: dict[str, list[Box | FlatRange]] = {}
    for p in mine:
        by_tensor.setdefault(p.tensor, []).append(p.region)
    out: list[LeafLayout] = []
    for name, regions in by_tensor.items():
        e = manifest.tensors[name]
        for k, region in enumerate(regions):
            nbytes = region.numel * itemsize(e.dtype)
            out.append(
                LeafLayout(
                    name, e.dtype, tuple(e.shape), region, 0, False, _phase(nbytes), k if len(regions) > 1 else None
                )
            )
    return out


# -- filling and writing the files -------------------------------------------------------------


def _batches(plan: SavePlan, batch_bytes: int) -> list[list[_Chunk]]:
    """The plan's pieces in file order, cut into batches of at most ``batch_bytes`` of (page-rounded)
    memory; a piece larger than that is cut into parts that fit (each a chunk of its own)."""
    chunks: list[_Chunk] = []
    for i, p in enumerate(plan.pieces):
        if _slot(p.length) <= batch_bytes:
            chunks.append(_Chunk(i, p, p.region, 0, p.length))
            continue
        size = itemsize(p.dtype)
        for first, part in split_region(p.region, size, batch_bytes - PAGE):  # PAGE: room for the phase
            chunks.append(_Chunk(i, p, part, first * size, part.numel * size))
    out: list[list[_Chunk]] = []
    used = 0
    for c in chunks:
        if not out or (used + c.slot > batch_bytes and out[-1]):
            out.append([])
            used = 0
        out[-1].append(c)
        used += c.slot
    return out


def _slot(nbytes: int) -> int:
    return math.ceil(nbytes / PAGE) * PAGE


def _fill(batch: list[_Chunk], source: Source, arenas: MemoryPool, staging_bytes: int) -> list[memoryview]:
    """Read a batch's chunks from the source into page-aligned memory (``arenas``); their byte views, in order.

    Source bytes that are not read straight into a piece are staged ``staging_bytes`` at a time
    (a source piece larger than that alone, see :func:`ucp.loading.partial.read_targets`).
    """
    # Not pre-faulted: pages are zero-filled as the reads land in them, in the reader threads,
    # instead of all at once here (peak RSS 480-530 MiB against ~620 MiB pre-faulted, 2.09 GiB reshape);
    # an earlier batch's memory is reused once the writer is done with it (no faults at all then).
    arena = arenas.buffer(sum(c.slot for c in batch))
    targets, views, pos = [], [], 0
    for c in batch:
        size = itemsize(c.piece.dtype)  # elements as opaque items: no torch, no casts
        view = arena.view(c.length, pos + c.phase)
        shape = tuple(c.region.shape) if isinstance(c.region, Box) else (c.length // size,)
        targets.append(Target(c.piece.name, RawArray(view, shape, size), c.region))
        views.append(view)
        pos += c.slot
    read_targets(
        source.storage,
        source.name,
        source.manifest,
        targets,
        verify=source.verify,
        index=source.index,
        staging_bytes=staging_bytes,
    )
    return views


class _StreamedViews(Sequence[PieceBytes]):
    """The bytes of a plan's pieces, produced batch by batch as the writer consumes them.

    Batches k + 1 and k + 2 are read while batch k is written; a batch's memory is freed once the
    writer and the checksum thread are done with it (the writer's requests in flight may still hold
    an earlier batch's large pieces: see :func:`reshape`). A piece cut into parts is handed to the
    writer as an iterator over its parts' views, which reads on as the writer goes through it.
    Fills run one at a time, in file order, so that a source piece read span by span is read (and
    its CRC computed) in order.
    """

    def __init__(
        self,
        job: _Job,
        fill: Callable[[list[_Chunk]], list[memoryview]],
        advance: Callable[[int, str], None],
        stop: threading.Event | None = None,
    ) -> None:
        self.job, self.fill, self.advance = job, fill, advance
        self.stop = stop  # set when the reshape is abandoned (Ctrl-C, another file failed): read no more

    def __len__(self) -> int:
        return len(self.job.plan.pieces)

    def __getitem__(self, i: Any) -> Any:  # Sequence protocol; the writer only iterates
        raise TypeError("streamed views are read in order only")

    def __iter__(self) -> Iterator[PieceBytes]:
        self._chunks = self._chunk_views()
        self._pieces = self._group(self._chunks)
        return self._pieces

    def close(self) -> None:
        """Stop reading ahead now (the writer failed or is done): not when the generators are collected."""
        for gen in (getattr(self, "_pieces", None), getattr(self, "_chunks", None)):
            if gen is not None:
                gen.close()

    @staticmethod
    def _group(chunks: Iterator[tuple[_Chunk, memoryview]]) -> Iterator[PieceBytes]:
        # Each group is read through (its first chunk here, the rest by the writer via _parts) before
        # groupby moves on: this generator is suspended at the yield until the writer asks for more.
        for _, group in itertools.groupby(chunks, key=lambda cv: cv[0].index):
            chunk, view = next(group)
            if chunk.whole:
                yield view
                continue
            parts = _parts([view], group)  # noqa: B031 - the rest of this group, read before groupby moves on
            del view  # this frame waits here while the writer goes through the parts: it must not hold one
            yield parts

    def _chunk_views(self) -> Iterator[tuple[_Chunk, memoryview]]:
        batches = self.job.batches
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-reshape-read") as pool:
            ahead = [pool.submit(self.fill, b) for b in batches[:READ_AHEAD]]
            try:
                for k, batch in enumerate(batches):
                    if self.stop is not None and self.stop.is_set():
                        raise RuntimeError(f"reshape abandoned while writing {self.job.plan.file}")
                    views = ahead.pop(0).result()
                    for i, (c, v) in enumerate(zip(batch, views)):
                        yield c, v
                        self.advance(c.length, c.piece.name)
                        if i == 0 and k + READ_AHEAD < len(batches):
                            # The writer has moved on to batch k, so it has let go of batch k - 2:
                            # BATCHES_HELD counts k - 1 to k + READ_AHEAD.
                            ahead.append(pool.submit(self.fill, batches[k + READ_AHEAD]))
            finally:
                if ahead and self.stop is not None:
                    # left early (a failed fill or writer): a fill still running may be waiting for
                    # memory that the failure's traceback holds; the pools let it go (MemoryPool.abandon)
                    self.stop.set()
                for fut in ahead:
                    fut.cancel()


def copied_crcs(plan: SavePlan, source: Source) -> dict[int, int]:
    """Piece index -> CRC-32C for the planned pieces that copy one stored piece whole (the same elements of
    the same tensor, and no other stored piece intersects them): their bytes are that piece's, whose CRC
    the read checks, so the writer need not checksum them a second time. Nothing for a source whose
    pieces carry no CRCs (``verify=False``). A consolidation or a plain DP/ZeRO reshape copies most
    pieces whole (replicated weights, tensors inside one partition): half the bytes hashed."""
    if not source.verify:
        return {}
    known: dict[int, int] = {}
    for i, p in enumerate(plan.pieces):
        shape = tuple(source.manifest.tensors[p.name].shape)
        stored = [
            fp for _, fp in source.index.by_tensor.get(p.name, ()) if transfers(fp.piece.region(), p.region, shape)
        ]
        if (
            len(stored) == 1
            and stored[0].piece.length == p.length
            and same_elements(stored[0].piece.region(), p.region, shape)
        ):
            known[i] = stored[0].piece.crc32c
    return known


def _results(futures: list[Future]) -> list[Any]:
    """The futures' results in order, the first failure raised as soon as it happens.

    Waits in short slices: a Ctrl-C taken by a worker thread's signal handler reaches the main thread
    only when that thread runs Python code, so a blocking wait would let every job finish first.
    """
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            failed.result()  # raises its error
    return [f.result() for f in futures]


def _parts(first: list[memoryview], rest: Iterator[tuple[_Chunk, memoryview]]) -> Iterator[memoryview]:
    """A piece's part views in order, each let go of once the writer asks for the next: a batch
    whose part was written is then free for reuse (``BATCHES_HELD`` counts on it)."""
    yield first.pop()
    for _, view in rest:
        yield view


def _write_files(
    jobs: list[_Job],
    plans: list[SavePlan],
    source: Source,
    arenas: MemoryPool,
    dst: Storage,
    temp: str,
    files_at_once: int,
    staging_bytes: int,
    advance: Callable[[int, str], None],
    stop: threading.Event,
) -> list[_commit.RankReport]:
    """Write the files, ``files_at_once`` at a time; ``stop`` is set when one fails (the others stop too)."""
    tree = source.manifest.state

    def run(job: _Job) -> _commit.RankReport:
        plan = job.plan
        fill = lambda batch: _fill(batch, source, arenas, staging_bytes)  # noqa: E731
        views = _StreamedViews(job, fill, advance, stop)
        try:
            records = write_rank_file(dst, f"{temp}/{plan.file}", plan, views, known_crcs=copied_crcs(plan, source))
        finally:
            views.close()  # a writer that failed on its own must not leave fills reading on
        return _commit.RankReport(
            rank=plan.rank,
            file=plan.file,
            file_size=plan.file_size,
            tensors=[(n, d, list(s)) for n, d, s in plan.tensors],
            pieces=records,
            state=tree,
        )

    with ThreadPoolExecutor(max_workers=files_at_once, thread_name_prefix="ucp-reshape") as pool:
        try:
            written = {r.rank: r for r in _results([pool.submit(run, job) for job in jobs])}
        except BaseException:
            stop.set()  # the jobs still running stop at their next batch; the pool's exit waits for that
            raise
    return [
        written.get(p.rank)
        or _commit.RankReport(rank=p.rank, tensors=[(n, d, list(s)) for n, d, s in p.tensors], state=tree)
        for p in plans
    ]
