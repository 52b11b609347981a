"""Step (b) of a save: the bytes of each planned piece as a contiguous CPU byte view.

The synchronous save takes views straight onto the tensors' memory (copying only
what is not already a contiguous CPU tensor), so the bytes must not change until
the write is done. An asynchronous save replaces :func:`snapshot` with copies into
staging buffers and returns to training before writing; everything after this
step only sees ``memoryview``\\ s: :func:`snapshot_into` copies a rank file's image into a staging arena.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

import kernels
from reshard.box import Box, FlatRange
from ucp.errors import SnapshotChangedError, UnsupportedStateError
from ucp.format.sharding import FlatShard, ShardedTensor, Shards, StreamedShard
from ucp.format.tree import Leaf
from ucp.saving.plan import PlannedPiece, SavePlan, assign_replicated, leaf_layouts
from ucp.store.writer import PieceBytes, StreamedParts

if TYPE_CHECKING:
    from ucp.saving.background.image import Progress
    from ucp.saving.staging import Arena

COPY_CHUNK = 64 << 20  # the snapshot reports progress to the writer every this many bytes


def leaf_part(leaf: Leaf, part: int | None = None) -> torch.Tensor | ShardedTensor | FlatShard | StreamedShard:
    """A leaf's value, or part ``part`` of a Shards leaf."""
    value = leaf.value
    return value.parts[part or 0] if isinstance(value, Shards) else value


def local_tensor(leaf: Leaf, part: int | None = None) -> torch.Tensor:
    """The tensor a leaf's piece is made of (the local part of a sharded leaf, or of part ``part`` of a Shards).

    A :class:`StreamedShard` has none: an UnsupportedStateError (a synchronous save, or an asynchronous one in
    thread mode, pulls its parts instead: :func:`write_views`, :func:`streamed_views`)."""
    value = leaf_part(leaf, part)
    if isinstance(value, StreamedShard):
        raise UnsupportedStateError(
            f"tensor {leaf.name!r} is a StreamedShard, whose bytes are produced while they are written: "
            "only a synchronous save (ucp.save, a CheckpointManager without async_save) or an asynchronous one "
            "in thread mode writes one"
        )
    return value.local if isinstance(value, (ShardedTensor, FlatShard)) else value


def image_sources(plan: SavePlan, leaves: Sequence[Leaf], arena: "Arena") -> Iterator[tuple[int, torch.Tensor]]:
    """Write the rank file's header and the zero padding between pieces into ``arena``; yield each
    piece's index and source tensor in file order (the caller copies it to ``plan.pieces[i].offset``)."""
    arena.view(plan.data_start)[:] = plan.header
    pos = plan.data_start
    for i, p in enumerate(plan.pieces):
        if p.offset > pos:  # padding the plan put before this piece: zeros, as ucp.save writes them
            arena.tensor(p.offset - pos, pos).zero_()
        pos = p.offset + p.length
        src = local_tensor(leaves[p.leaf], p.part).detach()
        if src.numel() * src.element_size() != p.length:
            raise UnsupportedStateError(
                f"tensor {p.name!r}: holds {src.numel() * src.element_size()} bytes but the plan expects "
                f"{p.length}; was the state dict changed while it was being saved?"
            )
        yield i, src


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor without autograd, conjugate or negative bits (a copy only if needed)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor's memory (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data  # memoryview(array), typed (numpy's stubs lack Buffer before 3.12)


def piece_bytes(piece: PlannedPiece, leaf: Leaf) -> memoryview:
    """The bytes of one planned piece, checked against the plan."""
    t = host_contiguous(local_tensor(leaf, piece.part))
    view = tensor_bytes(t)
    if view.nbytes != piece.length:
        raise UnsupportedStateError(
            f"tensor {piece.name!r}: holds {view.nbytes} bytes but the plan expects {piece.length}; "
            "was the state dict changed while it was being saved?"
        )
    return view


def snapshot(plan: SavePlan, leaves: Sequence[Leaf]) -> list[memoryview]:
    """Byte views of every piece the plan writes, in plan order."""
    return [piece_bytes(p, leaves[p.leaf]) for p in plan.pieces]


def write_views(plan: SavePlan, leaves: Sequence[Leaf]) -> list[PieceBytes]:
    """What a synchronous save hands the writer: :func:`snapshot`'s views, but a :class:`StreamedShard`'s
    parts, produced as the writer goes, where a leaf is one."""
    out: list[PieceBytes] = []
    for p in plan.pieces:
        value = leaf_part(leaves[p.leaf], p.part)
        out.append(StreamedParts(value.parts) if isinstance(value, StreamedShard) else piece_bytes(p, leaves[p.leaf]))
    return out


def streams(plan: SavePlan, leaves: Sequence[Leaf]) -> bool:
    """Whether the plan writes a :class:`StreamedShard` (its bytes are pulled while the file is written)."""
    return any(s is not None for s in streamed_sources(plan, leaves))


def sourced(plan: SavePlan, leaves: Sequence[Leaf]) -> bool:
    """Whether every :class:`StreamedShard` the plan writes has a ``source`` (files a writer process reads)."""
    return all(s.source is not None for s in streamed_sources(plan, leaves) if s is not None)


def streamed_sources(plan: SavePlan, leaves: Sequence[Leaf]) -> list[StreamedShard | None]:
    """Each planned piece's StreamedShard (None for the other pieces)."""
    out: list[StreamedShard | None] = []
    for p in plan.pieces:
        value = leaf_part(leaves[p.leaf], p.part)
        out.append(value if isinstance(value, StreamedShard) else None)
    return out


def streamed_views(plan: SavePlan, leaves: Sequence[Leaf]) -> list[PieceBytes]:
    """What an asynchronous save that streams hands its writer thread: each :class:`StreamedShard`'s parts,
    pulled as the writer goes (the producer keeps them consistent until then), and a private copy of every
    other piece's bytes, made now, so the caller may change those tensors once the save returns."""
    out: list[PieceBytes] = []
    for p in plan.pieces:
        value = leaf_part(leaves[p.leaf], p.part)
        if isinstance(value, StreamedShard):
            out.append(StreamedParts(value.parts))
        else:
            out.append(memoryview(bytearray(piece_bytes(p, leaves[p.leaf]))))
    return out


def replica_checksums(leaves: Sequence[Leaf], rank: int, world_size: int) -> list[tuple[str, Box | FlatRange, int]]:
    """``(tensor, region, CRC-32C)`` of every region this rank holds but another rank writes: plain
    tensors the planner gives to another rank, shard replicas with ``replica_id`` > 0. Compared
    with the written pieces at commit (``ucp.save(check_replicas=True)``)."""
    import crc32c

    layouts = [(i, lay) for i, leaf in enumerate(leaves) for lay in leaf_layouts(leaf)]
    owner = assign_replicated([lay for _, lay in layouts], world_size)
    out = []
    for i, lay in layouts:
        if (owner.get(lay.name) == rank) if lay.replicated else lay.replica_id == 0:
            continue  # written by this rank
        value = leaf_part(leaves[i], lay.part)
        if isinstance(value, StreamedShard):
            crc = 0
            for part in value.parts():
                crc = crc32c.crc32c(part, crc)
        else:
            crc = crc32c.crc32c(tensor_bytes(host_contiguous(local_tensor(leaves[i], lay.part))))
        out.append((lay.name, lay.region, crc))
    return out


class ChangeWatch:
    """Notices in-place changes to the tensors a deferred snapshot still has to read.

    With ``AsyncSaver(snapshot="background" | "none")`` the tensors are read after ``save``
    returned, and the caller promises not to change them before ``handle.wait_snapshot()``.
    torch bumps a tensor's version counter after every in-place operation on it or on a view of
    it (an optimizer step, ``copy_``, ``+=``), so comparing the counters taken at ``save`` with
    those after the copy turns a broken promise into a failed save naming the tensor, instead
    of a committed checkpoint mixing two steps. Not seen: writes torch does not count (through
    ``.data``, numpy views or raw pointers), inference tensors (they have no counter), and an
    operation still running when the last check is made.
    """

    def __init__(self, plan: SavePlan, leaves: Sequence[Leaf], *, aliased_only: bool = False) -> None:
        """``aliased_only``: watch only pieces whose bytes are read in place (a writer that reads
        the tensors' memory directly; other pieces were already copied by :func:`snapshot`)."""
        self._watched: list[tuple[str, torch.Tensor, int]] = []
        self._by_piece: dict[int, tuple[str, torch.Tensor, int]] = {}
        for i, p in enumerate(plan.pieces):
            t = local_tensor(leaves[p.leaf], p.part)
            if t.device.type != "cpu" or (aliased_only and not _read_in_place(t)):
                continue
            version = _version(t)
            if version is not None:
                self._by_piece[i] = entry = (p.name, t, version)
                self._watched.append(entry)

    def check_piece(self, index: int) -> None:
        """Raise :class:`SnapshotChangedError` if the tensor of piece ``index`` changed since the save began."""
        entry = self._by_piece.get(index)
        if entry is not None:
            _check(*entry)

    def check_all(self) -> None:
        """Raise :class:`SnapshotChangedError` for the first watched tensor that changed."""
        for entry in self._watched:
            _check(*entry)

    def release(self) -> None:
        """Drop the references to the caller's tensors (the snapshot no longer reads them)."""
        self._watched, self._by_piece = [], {}


def _version(t: torch.Tensor) -> int | None:
    if t.is_inference():
        return None
    return int(t._version)


def _read_in_place(t: torch.Tensor) -> bool:
    """Whether :func:`host_contiguous` hands back ``t``'s own memory rather than a copy."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _check(name: str, t: torch.Tensor, version: int) -> None:
    if int(t._version) != version:
        raise SnapshotChangedError(
            f"tensor {name!r} was changed in place while a deferred snapshot was still reading it "
            f"(version {version} -> {int(t._version)}); call handle.wait_snapshot() before changing saved "
            "tensors, or use snapshot='sync'",
            tensor=name,
        )


def snapshot_into(
    plan: SavePlan,
    leaves: Sequence[Leaf],
    arena: Arena,
    progress: "Progress",
    stream_for: Callable[[torch.device], Any],
    *,
    chunk: int | None = None,
    watch: ChangeWatch | None = None,
) -> list[Any]:
    """Copy the rank file's image (header, then every piece at its offset, zeros between) into ``arena``.

    Contiguous host tensors are copied chunk by chunk with ``kernels.copy_crc32c``, which
    checksums the bytes as it copies them (one pass over memory; the writer then reads only
    what it writes, never again for the checksum): they are declared in
    ``progress.checksummed`` and their CRC-32C put in ``progress.crcs``. Other host tensors
    (non-contiguous, conjugate or negative views) are copied with ``Tensor.copy_`` and
    checksummed by the writer. Each chunk advances ``progress`` so the writer can follow.
    CUDA tensors are queued on a side stream (returned events mark their completion); the
    caller's current stream waits for those copies, so later kernels cannot change the bytes
    before they are copied.

    ``watch`` (deferred snapshots, host tensors only): each piece's tensor is checked after its
    copy, and all of them once more before the last byte is released to the writer, so a tensor
    changed before its copy ended fails the save instead of being committed half old, half new.
    """
    chunk = chunk or COPY_CHUNK
    hold = plan.file_size - 1 if watch is not None else plan.file_size  # the writer cannot finish before the check

    def advance(n: int) -> None:
        progress.advance(min(n, hold))

    # Declared before the first advance: the writer reads it once it sees the first bytes.
    progress.checksummed = frozenset(
        i for i, p in enumerate(plan.pieces) if _fused_copy(local_tensor(leaves[p.leaf], p.part))
    )
    events: list[Any] = []
    for i, src in image_sources(plan, leaves, arena):
        if i == 0:
            advance(plan.data_start)
        p = plan.pieces[i]
        if i in progress.checksummed:
            _copy_checksummed(i, src, p.offset, arena, progress, chunk, advance if not events else None, watch)
            continue
        dst = arena.tensor(p.length, p.offset).view(src.dtype)
        if src.device.type == "cuda":
            events.append(_copy_from_cuda(dst.view(src.shape), src, stream_for(src.device)))
            continue
        if src.device.type != "cpu":
            src = src.cpu()
        dst.view(src.shape).copy_(src)
        if watch is not None:
            watch.check_piece(i)
        if not events:
            advance(p.offset + p.length)
    if watch is not None:
        watch.check_all()
        watch.release()
    if not events:
        progress.advance(plan.file_size)
    return events


def _fused_copy(t: torch.Tensor) -> bool:
    """Whether :func:`snapshot_into` copies ``t`` with ``kernels.copy_crc32c`` (its bytes, as they lie)."""
    return t.device.type == "cpu" and _read_in_place(t)


def _copy_checksummed(
    index: int,
    src: torch.Tensor,
    offset: int,
    arena: Arena,
    progress: "Progress",
    chunk: int,
    advance: Callable[[int], None] | None,
    watch: ChangeWatch | None,
) -> None:
    """Copy piece ``index`` (a contiguous host tensor) to ``offset`` in ``arena``, recording its CRC-32C in
    ``progress.crcs`` before ``advance`` passes the piece's end (None: no advancing, a CUDA copy before
    it is still running)."""
    length = src.numel() * src.element_size()
    dst = arena.tensor(length, offset)
    data = src.reshape(-1).view(torch.uint8)
    crc = 0
    for a in range(0, length, chunk):
        b = min(a + chunk, length)
        crc = kernels.copy_crc32c(dst[a:b], data[a:b], crc)
        if watch is not None:
            watch.check_piece(index)
        if b == length:
            progress.crcs[index] = crc  # before the writer may pass the piece's end
        if advance is not None:
            advance(offset + b)
    if not length:
        progress.crcs[index] = 0
        if watch is not None:
            watch.check_piece(index)


def on_host(plan: SavePlan, leaves: Sequence[Leaf]) -> bool:
    """Whether every piece the plan writes comes from a CPU tensor (a background copy needs that)."""
    return all(local_tensor(leaves[p.leaf], p.part).device.type == "cpu" for p in plan.pieces)


def _copy_from_cuda(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> Any:
    current = torch.cuda.current_stream(src.device)
    stream.wait_stream(current)  # the copy sees everything queued before async_save
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        src.record_stream(stream)  # the allocator must not reuse src's memory before the copy ran
        event = torch.cuda.Event()
        event.record(stream)
    current.wait_event(event)  # later work on the current stream cannot modify src before it is copied
    return event
