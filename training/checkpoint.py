"""The checkpoint seam: every tensor a rank holds, as ucp pieces of the *global* tensors.

The engine's state lives in a few kinds of buffers (compute-dtype weights, fp32 masters, Adam's
``exp_avg``/``exp_avg_sq``), TP-local and partly ZeRO-partitioned. The resolved layout
(:class:`reshard.RankView`) already says, slot by slot, which region of which global tensor each
region of each buffer holds. :func:`pieces_of` turns a (buffer, tensor) pair into
``ucp.ShardedTensor`` / ``ucp.FlatShard`` views of the live storage:

* a slot whose global region is a flat range -> ``FlatShard(local_1d, global_shape, start)``;
* a slot whose global region is a box -> ``ShardedTensor(local_view, global_shape, offsets)``
  (the local view is the box's elements in row-major order: a sub-box of a model-form tensor, or
  a run of a flat partition reshaped to the box);
* ``replica_id`` is the slot's replica: 0 on exactly one rank per region (it writes it on save);
  every rank still gets its replicas filled on load.

Because pieces are views, ``ucp.load(path, into=...)`` filling them loads the engine in place.

One rank may hold several disjoint regions of one tensor (a TP shard of the fused QKV: its q, k
and v rows; a ZeRO partition of a row-parallel shard: up to three regions), so the structures here
map each tensor name to a *list* of pieces (a ``ucp.Shards`` in the state dict to save). With tp = 1 every list has at most one piece (slots
that continue each other are merged first: a fused tensor at tp = 1 is one piece, not one per part).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from reshard import Box, FlatRange, LocalBuffer, merge_slots
from ucp.format.sharding import FlatShard, ShardedTensor, Shards

Piece = ShardedTensor | FlatShard
SECTIONS = ("model", "fp32_master", "exp_avg", "exp_avg_sq")


def pieces_of(tensor: torch.Tensor, buf: LocalBuffer, shapes: Mapping[str, Sequence[int]]) -> list[tuple[str, Piece]]:
    """``(global tensor name, piece)`` for every (merged) slot of ``buf``, viewing ``tensor`` (shaped ``buf.shape``)."""
    if tuple(tensor.shape) != tuple(buf.shape):
        raise ValueError(f"buffer {buf.name!r}: tensor of shape {list(tensor.shape)}, layout says {list(buf.shape)}")
    out: list[tuple[str, Piece]] = []
    for s in merge_slots(buf.slots):
        gshape = tuple(shapes[s.tensor])
        if isinstance(s.local, Box):
            local = tensor[s.local.slices()]
        else:
            local = tensor.reshape(-1)[s.local.start : s.local.stop]
        if isinstance(s.glob, FlatRange):
            out.append((s.tensor, FlatShard(local.reshape(-1), gshape, s.glob.start, s.replica)))
        else:
            out.append((s.tensor, ShardedTensor(local.view(s.glob.shape), gshape, s.glob.offsets, s.replica)))
    return out


@dataclass
class CheckpointTargets:
    """This rank's pieces, by section (``model`` and the optimizer states) and global tensor name."""

    shapes: dict[str, tuple[int, ...]]
    sections: dict[str, dict[str, list[Piece]]] = field(default_factory=dict)

    def add(self, section: str, name: str, piece: Piece) -> None:
        self.sections.setdefault(section, {}).setdefault(name, []).append(piece)

    def items(self) -> Iterator[tuple[str, str, list[Piece]]]:
        for section, tensors in self.sections.items():
            for name, pieces in tensors.items():
                yield section, name, pieces

    def nested(self) -> dict[str, dict[str, Piece | Shards]]:
        """``{section: {name: piece}}``, or a ``ucp.Shards`` of the pieces where this rank holds several regions."""
        return {
            sec: {n: ps[0] if len(ps) == 1 else Shards(ps) for n, ps in t.items()} for sec, t in self.sections.items()
        }

    def describe(self) -> list[dict[str, Any]]:
        """Plain-data summary of every piece (section, name, kind, region, replica) for checks and tests."""
        out = []
        for section, name, pieces in self.items():
            for p in pieces:
                if isinstance(p, FlatShard):
                    region = {"flat": [p.start, p.stop]}
                else:
                    region = {"offsets": list(p.offsets), "shape": list(p.local.shape)}
                out.append({"section": section, "name": name, "replica": p.replica_id, "dtype": str(p.dtype), **region})
        return out


def build_targets(
    buffers: Sequence[tuple[str, LocalBuffer, torch.Tensor]], shapes: Mapping[str, Sequence[int]]
) -> CheckpointTargets:
    targets = CheckpointTargets({n: tuple(s) for n, s in shapes.items()})
    for section, buf, tensor in buffers:
        for name, piece in pieces_of(tensor, buf, shapes):
            targets.add(section, name, piece)
    return targets


@torch.no_grad()
def fill_from_full(targets: CheckpointTargets, get: Callable[[str, str], torch.Tensor | None]) -> int:
    """Fill every piece (replicas included) from full global tensors; ``get(section, name)`` may return None to skip.

    The reference loader: what ``ucp.load(into=...)`` does from a checkpoint, done from tensors in
    memory. Returns the number of elements written.
    """
    n = 0
    for section, name, pieces in targets.items():
        full = get(section, name)
        if full is None:
            continue
        if tuple(full.shape) != targets.shapes[name]:
            raise ValueError(
                f"{section} {name!r}: full tensor of shape {list(full.shape)}, expected {list(targets.shapes[name])}"
            )
        for p in pieces:
            if isinstance(p, FlatShard):
                p.local.copy_(full.reshape(-1)[p.start : p.stop])
            else:
                p.local.copy_(full[p.box.slices()])
            n += p.local.numel()
    return n


def assemble(
    pieces: Sequence[Piece], shape: Sequence[int], dtype: torch.dtype = torch.float32, replicas: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A full tensor from pieces (replica 0 only unless ``replicas``), and a count of writes per element."""
    full = torch.zeros(tuple(shape), dtype=dtype)
    count = torch.zeros(tuple(shape), dtype=torch.int32)
    flat, cflat = full.view(-1), count.view(-1)
    for p in pieces:
        if p.replica_id and not replicas:
            continue
        if isinstance(p, FlatShard):
            flat[p.start : p.stop] = p.local.to("cpu", dtype)
            cflat[p.start : p.stop] += 1
        else:
            full[p.box.slices()] = p.local.to("cpu", dtype)
            count[p.box.slices()] += 1
    return full, count
