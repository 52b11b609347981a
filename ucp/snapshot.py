"""Step (b) of a save: the bytes of each planned piece as a contiguous CPU byte view.

The synchronous save takes views straight onto the tensors' memory (copying only
what is not already a contiguous CPU tensor), so the bytes must not change until
the write is done. An asynchronous save replaces :func:`snapshot` with copies into
staging buffers and returns to training before writing; everything after this
step only sees ``memoryview``\\ s.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import UnsupportedStateError
from .plan import PlannedPiece, SavePlan
from .sharding import FlatShard, ShardedTensor, Shards
from .tree import Leaf


def local_tensor(leaf: Leaf, part: int | None = None) -> torch.Tensor:
    """The tensor a leaf's piece is made of (the local part of a sharded leaf, or of part ``part`` of a Shards)."""
    value = leaf.value
    if isinstance(value, Shards):
        value = value.parts[part or 0]
    return value.local if isinstance(value, (ShardedTensor, FlatShard)) else value


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
    return memoryview(flat.view(torch.uint8).numpy())


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
