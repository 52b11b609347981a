"""How a rank says "this local tensor is part of a bigger one": ShardedTensor and FlatShard.

A plain ``torch.Tensor`` in a state dict is the whole logical tensor (and, in a
multi-rank save, the same on every rank). Wrapping the local tensor says which
part of the global tensor it is, so that save writes each part once and load can
fill any other layout from it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, Union

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from ucp.store.file_ranges import FileRange

from reshard.box import Box, FlatRange


def _ints(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)
    if any(v < 0 for v in out):
        raise ValueError(f"{what} must be non-negative, got {list(out)}")
    return out


@dataclass(eq=False)
class ShardedTensor:
    """``local`` occupies the N-d box ``[offsets, offsets + local.shape)`` of a tensor of ``global_shape``.

    Ranks holding the same box (data-parallel replicas) give it distinct ``replica_id``;
    only replica 0 writes it.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replica_id: int = 0

    def __post_init__(self) -> None:
        if not _is_torch_tensor(self.local):
            raise TypeError(f"ShardedTensor.local must be a torch.Tensor, got {type(self.local).__name__}")
        self.global_shape = _ints(self.global_shape, "global_shape")
        self.offsets = _ints(self.offsets, "offsets")
        self.replica_id = int(self.replica_id)
        if not (len(self.global_shape) == len(self.offsets) == self.local.dim()):
            raise ValueError(
                f"ShardedTensor: local tensor of rank {self.local.dim()}, global_shape {list(self.global_shape)} "
                f"and offsets {list(self.offsets)} must all have the same rank"
            )
        if not self.box.within(self.global_shape):
            raise ValueError(
                f"ShardedTensor: box offsets {list(self.offsets)} + local shape {list(self.local.shape)} "
                f"lies outside global_shape {list(self.global_shape)}"
            )

    @property
    def box(self) -> Box:
        return Box(self.offsets, tuple(self.local.shape))

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype


@dataclass(eq=False)
class FlatShard:
    """``local_1d`` holds elements ``[start, start + numel)`` of the row-major flattening of a tensor of ``global_shape``.

    This is how ZeRO-style optimizers partition parameters: a flat buffer cut at arbitrary
    element boundaries. Ranks holding the same range give it distinct ``replica_id``.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    start: int
    replica_id: int = 0

    def __post_init__(self) -> None:
        if not _is_torch_tensor(self.local):
            raise TypeError(f"FlatShard.local must be a torch.Tensor, got {type(self.local).__name__}")
        if self.local.dim() != 1:
            raise ValueError(f"FlatShard.local must be 1-d, got shape {list(self.local.shape)}")
        self.global_shape = _ints(self.global_shape, "global_shape")
        self.start = int(self.start)
        self.replica_id = int(self.replica_id)
        total = math.prod(self.global_shape)
        if self.start < 0 or self.stop > total:
            raise ValueError(
                f"FlatShard: range [{self.start}, {self.stop}) lies outside the {total} elements "
                f"of global_shape {list(self.global_shape)}"
            )

    @property
    def stop(self) -> int:
        return self.start + self.local.numel()

    @property
    def range(self) -> FlatRange:
        return FlatRange(self.start, self.stop)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype


@dataclass(eq=False)
class StreamedShard:
    """A region of a global tensor whose bytes are produced while the save writes them, not held in memory.

    For state that lives outside memory (an optimizer offloaded to NVMe): ``parts()`` is called once,
    by the writer, and yields consecutive byte views that together hold ``region``'s elements in
    row-major order as ``dtype``. The producer may reuse a part's memory as soon as the next part is
    asked for: the writer writes and checksums each part before that. The piece it becomes is an
    ordinary one (the manifest cannot tell). A synchronous save writes one (``ucp.save``, a
    ``CheckpointManager`` without ``async_save``), and so does an asynchronous save in thread mode: its
    writer thread calls ``parts()`` after the save returned, so the producer keeps the bytes as they
    were at the save until then (training.offload streams a copy of its swap files). It is never a load
    target.

    ``phase``: where the first part's bytes sit within a 4 KiB page (its address mod 4096), when every
    later part starts where the previous one ends modulo 4096 (page-aligned buffers cut at page
    multiples): the save then places the piece so that the writer DMAs the parts from the producer's
    memory instead of copying them into its staging.

    ``source``: gives the same bytes as runs of checked blocks of files on disk
    (:class:`ucp.store.file_ranges.FileRange`), which a writer *process* reads itself
    (``AsyncSaver(mode="process")``; without a source such a save refuses the shard). It is called once
    ``ready`` (if any) has resolved: once those files hold the bytes (the producer's copy is made; its
    exception fails the save), on the thread that resolved it. The producer removes the files once the save
    is done.
    """

    dtype: torch.dtype
    global_shape: tuple[int, ...]
    region: Box | FlatRange
    parts: Callable[[], Iterable[memoryview]]
    replica_id: int = 0
    phase: int | None = None
    source: Callable[[], Sequence[FileRange]] | None = None
    ready: Future[None] | None = None

    def __post_init__(self) -> None:
        self.global_shape = _ints(self.global_shape, "global_shape")
        self.replica_id = int(self.replica_id)
        inside = (
            self.region.within(self.global_shape)
            if isinstance(self.region, Box)
            else 0 <= self.region.start <= self.region.stop <= math.prod(self.global_shape)
        )
        if not inside:
            raise ValueError(f"StreamedShard: region {self.region} lies outside global_shape {list(self.global_shape)}")


Part = Union[ShardedTensor, FlatShard, StreamedShard]


class Shards:
    """Several regions of ONE global tensor held by this rank (one logical tensor, one name).

    Tensor parallelism gives a rank non-adjacent parts of a tensor: a fused-QKV shard
    holds its rows of q, k and v (3 boxes), a ZeRO flat partition of a row-parallel
    shard up to 3 flat ranges. Each part keeps its own ``replica_id``; parts may be
    views of one local tensor. Save writes each part as its own piece.
    """

    def __init__(self, parts: Sequence[Part]) -> None:
        parts = list(parts)
        if not parts:
            raise ValueError("Shards needs at least one part")
        for i, p in enumerate(parts):
            if not isinstance(p, (ShardedTensor, FlatShard, StreamedShard)):
                raise TypeError(
                    f"Shards part {i} must be a ShardedTensor, FlatShard or StreamedShard, got {type(p).__name__}"
                )
        first = parts[0]
        for i, p in enumerate(parts[1:], 1):
            if p.global_shape != first.global_shape:
                raise ValueError(
                    f"Shards part {i} has global_shape {list(p.global_shape)}, part 0 has {list(first.global_shape)}"
                )
            if p.dtype != first.dtype:
                raise ValueError(f"Shards part {i} has dtype {p.dtype}, part 0 has {first.dtype}")
        self.parts: tuple[Part, ...] = tuple(parts)

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.parts[0].global_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def __repr__(self) -> str:
        return f"Shards({len(self.parts)} parts of {list(self.global_shape)} {self.dtype})"


TensorLike = Union["torch.Tensor", ShardedTensor, FlatShard, StreamedShard, Shards]


def _is_torch_tensor(obj: object) -> bool:
    """isinstance(obj, torch.Tensor) without importing torch: where it was never imported, nothing is one."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_tensor_like(obj: object) -> bool:
    return isinstance(obj, (ShardedTensor, FlatShard, StreamedShard, Shards)) or _is_torch_tensor(obj)


def parts_of(value: TensorLike) -> tuple[torch.Tensor | Part, ...]:
    """The single-region values a leaf is made of: a Shards leaf's parts, else the value itself."""
    return value.parts if isinstance(value, Shards) else (value,)
