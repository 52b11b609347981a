"""Step (a) of a save: which pieces this rank writes and where they go in its file. Pure and cached.

A plan depends only on the *layout* of the state dict (names, dtypes, shapes,
placements), never on tensor values, so a training loop that saves the same
model every N steps plans once: :func:`plan_save` looks the layout up in a
small cache keyed by :func:`layout_signature`.

Who writes what:

* ``ShardedTensor`` / ``FlatShard`` with ``replica_id == 0``: the rank holding it;
  other replicas write nothing.
* a ``Shards`` leaf: each part as above, one piece per part; a file's further
  pieces of one tensor get header entries ``<name>#1``, ``<name>#2``, ...
* plain tensors are assumed replicated (equal on every rank); each is written by
  one rank chosen by a deterministic rule all ranks compute alike without talking:
  largest first, each to the rank with the fewest replicated bytes so far.
  ``ucp.save(check_replicas=True)`` verifies the assumption (``snapshot.replica_checksums``,
  compared at commit by ``commit.check_replicas``).

The data file is a safetensors file whose header is padded so the data starts at
a multiple of 4096; pieces follow in descending item size, then by name. Each
large piece starts at a file offset congruent to its tensor's memory address
modulo 4096 (its *phase*), so that ``aio`` can DMA the piece straight from the
tensor's memory with O_DIRECT instead of copying it into staging blocks; other
pieces start at a multiple of their item size. The bytes skipped to get there
are ``__pad__.<k>`` entries of dtype U8 in the header (safetensors allows no gaps).
Tensors are updated in place during training, so their addresses, and the plan,
stay the same from save to save.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from reshard.box import Box, FlatRange
from ucp.errors import UnsupportedStateError
from ucp.format.dtypes import dtype_name, itemsize
from ucp.format.manifest import FORMAT_VERSION
from ucp.format.sharding import FlatShard, ShardedTensor, Shards, StreamedShard
from ucp.format.tree import ENTRY_SEP, PAD_PREFIX, Leaf, path_str

if TYPE_CHECKING:
    import torch

DATA_ALIGNMENT = 4096
DIRECT_MIN_BYTES = 256 << 10  # smaller pieces are copied through staging anyway: no phase


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class LeafLayout:
    """What planning needs to know about one tensor leaf (no data)."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    region: Box | FlatRange
    replica_id: int
    replicated: bool  # a plain tensor: every rank holds all of it
    phase: int | None = None  # memory address mod DATA_ALIGNMENT of a large in-memory piece
    part: int | None = None  # index in a Shards leaf's parts; part > 0 continues the previous leaf

    @property
    def numel(self) -> int:
        return self.region.numel

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class PlannedPiece:
    """A piece this rank writes: leaf ``leaf`` of the state dict goes to ``[offset, offset + length)`` of its file."""

    name: str
    leaf: int
    dtype: str
    global_shape: tuple[int, ...]
    region: Box | FlatRange
    offset: int
    length: int
    part: int | None = None  # which part of a Shards leaf
    entry: str | None = None  # header entry name when not ``name`` (a further piece of the tensor)

    @property
    def local_shape(self) -> list[int]:
        return list(self.region.shape) if isinstance(self.region, Box) else [self.region.numel]


@dataclass(frozen=True)
class SavePlan:
    """The complete write plan of one rank. ``file`` is None when the rank writes nothing."""

    rank: int
    world_size: int
    file: str | None
    header: bytes  # the first ``data_start`` bytes of the file: length prefix + padded JSON header
    pieces: tuple[PlannedPiece, ...]
    file_size: int
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, global shape) of every leaf

    @property
    def data_start(self) -> int:
        return len(self.header)


def leaf_layouts(leaf: Leaf) -> list[LeafLayout]:
    """One layout per region of a leaf: per part of a ``Shards``, else just :func:`leaf_layout`."""
    if not isinstance(leaf.value, Shards):
        return [leaf_layout(leaf)]
    return [dataclasses.replace(leaf_layout(leaf, part), part=i) for i, part in enumerate(leaf.value.parts)]


def leaf_layout(leaf: Leaf, value: Any = None) -> LeafLayout:
    """Describe a leaf's (or one part's) placement; raises UnsupportedStateError for tensors the format cannot hold."""
    value = leaf.value if value is None else value
    if isinstance(value, StreamedShard):  # bytes produced at write time: the phase of the producer's buffers
        dtype = dtype_name(value.dtype, tensor=leaf.name)
        large = value.region.numel * itemsize(dtype) >= DIRECT_MIN_BYTES
        phase = value.phase % DATA_ALIGNMENT if value.phase is not None and large else None
        return LeafLayout(leaf.name, dtype, value.global_shape, value.region, value.replica_id, False, phase)
    local = value.local if isinstance(value, (ShardedTensor, FlatShard)) else value
    where = f"{path_str(leaf.path)} (tensor {leaf.name!r})"
    import torch  # a leaf holds torch tensors, so torch is loaded already

    if type(local) is not torch.Tensor and type(local) is not torch.nn.Parameter:
        raise UnsupportedStateError(f"{where}: {_subclass_text(local)}")
    if local.layout != torch.strided or local.is_nested or local.device.type == "meta":
        raise UnsupportedStateError(f"{where}: only dense (strided) tensors with data can be saved")
    dtype = dtype_name(local.dtype, tensor=leaf.name)
    phase = memory_phase(local)
    if isinstance(value, ShardedTensor):
        return LeafLayout(leaf.name, dtype, value.global_shape, value.box, value.replica_id, False, phase)
    if isinstance(value, FlatShard):
        return LeafLayout(leaf.name, dtype, value.global_shape, value.range, value.replica_id, False, phase)
    shape = tuple(local.shape)
    return LeafLayout(leaf.name, dtype, shape, Box.full(shape), 0, True, phase)


def _subclass_text(t: Any) -> str:
    """Why a tensor subclass is refused, and what to save instead (its bytes are not the subclass's values
    in general: a DTensor's are one shard of a tensor spread over a mesh)."""
    kind = type(t)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if kind.__name__ == "DTensor":
        return (
            f"is a DTensor ({name}), which ucp.save does not store: save its local shard as a ucp.ShardedTensor "
            "(local=t.to_local(), with the shard's global shape and box), or t.full_tensor()"
        )
    return (
        f"is a tensor subclass ({name}), which ucp.save does not store (only torch.Tensor and nn.Parameter): "
        "save a plain tensor, e.g. t.as_subclass(torch.Tensor) when its storage holds its values"
    )


def memory_phase(t: "torch.Tensor") -> int | None:
    """Where a large host tensor's bytes sit within a 4 KiB page, if they will be written from in place."""
    if (
        t.device.type != "cpu"
        or not t.is_contiguous()
        or t.is_conj()
        or t.is_neg()
        or t.numel() * t.element_size() < DIRECT_MIN_BYTES
    ):
        return None
    return t.data_ptr() % DATA_ALIGNMENT


def layout_signature(layouts: Sequence[LeafLayout], rank: int, world_size: int) -> tuple[Any, ...]:
    """Everything a plan depends on; equal signatures give equal plans."""
    return (rank, world_size, tuple(layouts))


def assign_replicated(layouts: Sequence[LeafLayout], world_size: int) -> dict[str, int]:
    """Writer rank of each replicated tensor: largest first, to the least loaded rank (ties: lowest rank)."""
    load = [0] * world_size
    owner: dict[str, int] = {}
    for lay in sorted((x for x in layouts if x.replicated), key=lambda x: (-x.nbytes, x.name)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owner[lay.name] = r
        load[r] += max(lay.nbytes, 1)
    return owner


def make_plan(layouts: Sequence[LeafLayout], rank: int, world_size: int) -> SavePlan:
    """Plan one rank's file (uncached; see :func:`plan_save`)."""
    owner = assign_replicated(layouts, world_size)
    leaf_of, leaf = [], -1
    for lay in layouts:  # the parts of a Shards leaf are consecutive layouts with part 0, 1, ...
        leaf += 0 if lay.part else 1
        leaf_of.append(leaf)
    mine = [
        (leaf_of[i], lay)
        for i, lay in enumerate(layouts)
        if (owner.get(lay.name) == rank if lay.replicated else lay.replica_id == 0)
    ]
    mine.sort(key=lambda t: (-itemsize(t[1].dtype), t[1].name))  # stable: parts stay in order
    tensors = tuple((lay.name, lay.dtype, lay.global_shape) for lay in layouts if not lay.part)
    if not mine:
        return SavePlan(rank, world_size, None, b"", (), 0, tensors)

    entries: dict[str, Any] = {
        "__metadata__": {"format": "ucp", "ucp_format_version": str(FORMAT_VERSION), "rank": str(rank)}
    }
    rel = 0
    spans = []
    entry_names: list[str | None] = []  # None: the entry is the tensor name
    count: dict[str, int] = {}
    for _, lay in mine:
        k = count.get(lay.name, 0)
        count[lay.name] = k + 1
        entry = f"{lay.name}{ENTRY_SEP}{k}" if k else None
        entry_names.append(entry)
        n = lay.nbytes
        want, modulus = (lay.phase, DATA_ALIGNMENT) if lay.phase is not None else (0, itemsize(lay.dtype))
        gap = (want - rel) % modulus
        if gap:
            entries[f"{PAD_PREFIX}{len(entries) - 1}"] = {
                "dtype": "U8",
                "shape": [gap],
                "data_offsets": [rel, rel + gap],
            }
            rel += gap
        shape = list(lay.region.shape) if isinstance(lay.region, Box) else [lay.region.numel]
        entries[entry or lay.name] = {"dtype": lay.dtype, "shape": shape, "data_offsets": [rel, rel + n]}
        spans.append((rel, n))
        rel += n
    header_json = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    data_start = math.ceil((8 + len(header_json)) / DATA_ALIGNMENT) * DATA_ALIGNMENT
    header_json += b" " * (data_start - 8 - len(header_json))
    header = struct.pack("<Q", len(header_json)) + header_json
    pieces = tuple(
        PlannedPiece(lay.name, i, lay.dtype, lay.global_shape, lay.region, data_start + off, n, lay.part, entry)
        for (i, lay), (off, n), entry in zip(mine, spans, entry_names)
    )
    return SavePlan(rank, world_size, rank_file_name(rank), header, pieces, data_start + rel, tensors)


class PlanCache:
    """A small LRU of plans keyed by layout signature, with hit/miss counters."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[tuple[Any, ...], SavePlan] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_make(self, layouts: Sequence[LeafLayout], rank: int, world_size: int) -> SavePlan:
        key = layout_signature(layouts, rank, world_size)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                self.hits += 1
                return plan
            self.misses += 1
        plan = make_plan(layouts, rank, world_size)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.hits = self.misses = 0


PLAN_CACHE = PlanCache()


def plan_save(leaves: Sequence[Leaf], rank: int, world_size: int, *, cache: PlanCache | None = PLAN_CACHE) -> SavePlan:
    """The plan for these leaves on this rank, from the cache when the layout was seen before."""
    layouts = [lay for leaf in leaves for lay in leaf_layouts(leaf)]
    if cache is None:
        return make_plan(layouts, rank, world_size)
    return cache.get_or_make(layouts, rank, world_size)
