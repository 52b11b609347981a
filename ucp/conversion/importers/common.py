"""What every importer hands back, and the helpers that turn foreign flat buffers into ucp leaves.

An importer reads a foreign checkpoint into an :class:`Imported` (a state dict for ``ucp.save``,
its step and metadata) without copying tensor data where it can: the leaves are views of
memory-mapped files, and a tensor that a foreign format split over several flat buffers becomes a
``ucp.Shards`` of ``ucp.FlatShard`` views (each written as its own piece), so nothing is
concatenated in memory. ``ucp.load`` assembles such a tensor whole, or reshards it.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ucp.conversion.importers.errors import ForeignCheckpointError
from ucp.conversion.importers.stored import StoredTensor, is_stored
from ucp.format.sharding import FlatShard, Shards, is_tensor_like
from ucp.format.tree import MAX_DEPTH
from ucp.store.storage import escapes

if TYPE_CHECKING:  # torch is imported by the functions that build torch tensors, so reading on disk never needs it
    import torch

# progress(done, total, what) — the signature of ucp.cli.common.progress_bar's update.
Progress = Callable[[int, int, str], None]


def inside(root: str | os.PathLike[str], file: str | os.PathLike[str]) -> Path:
    """``file`` as a Path, refused unless it resolves inside the source folder ``root``.

    Every importer passes each file the source names (index shards, tag folders, rank files,
    ``.metadata`` data files) through this before opening it: a symlink leading out of the source
    would import bytes that are not the checkpoint's. Links within ``root`` are fine. Raises
    ForeignCheckpointError naming the file and where it points.
    """
    target = escapes(root, file)
    if target is not None:
        raise ForeignCheckpointError(
            f"file {os.fspath(file)!r} resolves to {target}, outside the source checkpoint folder "
            f"{os.path.realpath(root)}; refusing to read it",
            file=os.fspath(file),
        )
    return Path(file)


@dataclass
class Imported:
    """A foreign checkpoint read into ucp's terms: ``ucp.save(state, dst, step=step, metadata=metadata)``."""

    state: dict[str, Any]
    step: int | None
    metadata: dict[str, Any] = field(default_factory=dict)


class Segments:
    """Several 1-d tensors (torch or stored) seen as their concatenation, without concatenating them.

    Why: ZeRO-3 keeps a rank's partition as a list of sub-group buffers; a parameter's chunk is
    found by its offset in the concatenation and may, in principle, straddle two buffers.
    """

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = [p.detach().reshape(-1) for p in parts]
        self.starts: list[int] = []
        total = 0
        for p in self.parts:
            self.starts.append(total)
            total += p.numel()
        self.numel = total

    def views(self, start: int, stop: int) -> list[tuple[Any, int]]:
        """``(view, offset of the view's first element relative to start)`` covering ``[start, stop)``."""
        if not 0 <= start <= stop <= self.numel:
            raise IndexError(f"range [{start}, {stop}) outside the {self.numel} elements")
        out: list[tuple[Any, int]] = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        pos = start
        while pos < stop:
            base, part = self.starts[i], self.parts[i]
            end = min(stop, base + part.numel())
            if end > pos:
                out.append((part[pos - base : end - base], pos - start))
                pos = end
            i += 1
        return out


def leaf(parts: Sequence[tuple[torch.Tensor, int]], shape: Sequence[int]) -> torch.Tensor | Shards:
    """A ucp leaf for a tensor of ``shape`` given as flat ``(view, start element)`` parts covering it.

    One part covering everything is the tensor itself (reshaped view: one box piece); several become a
    ``Shards`` of ``FlatShard`` views (one flat piece each). Empty parts are dropped.
    """
    import torch

    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    parts = [(v, s) for v, s in parts if v.numel() > 0]
    if not parts:
        if numel:
            raise ValueError(f"no data for a tensor of shape {list(shape)}")
        return torch.empty(shape, dtype=torch.float32)
    if len(parts) == 1 and parts[0][1] == 0 and parts[0][0].numel() == numel:
        return parts[0][0].view(shape)
    return Shards([FlatShard(v, shape, s) for v, s in parts])


def cast_leaf(value: torch.Tensor | Shards, dtype: torch.dtype) -> torch.Tensor | Shards:
    """The same leaf in another dtype (a copy when the dtype differs; a fresh wrapper over the same views
    otherwise, so two names may share data)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value if value.dtype == dtype else value.to(dtype)
    parts = []
    for p in value.parts:
        assert isinstance(p, FlatShard)  # an importer's Shards hold flat pieces only (see leaf)
        parts.append(FlatShard(p.local if p.dtype == dtype else p.local.to(dtype), p.global_shape, p.start))
    return Shards(parts)


def plain(value: Any, *, file: str | os.PathLike[str]) -> Any:
    """A value from the foreign pickle ``file`` as something ucp.save stores: containers, scalars,
    tensors; attribute bags become dicts, int subclasses ints, anything else its ``repr``.

    Raises ForeignCheckpointError naming ``file`` for a value nested deeper than a checkpoint's
    state may be (a pickle can nest thousands of levels deep, or hold a list that contains itself).
    """
    return _plain(value, 0, file)


def _plain(value: Any, depth: int, file: str | os.PathLike[str]) -> Any:
    if depth > MAX_DEPTH:
        raise ForeignCheckpointError(
            f"file {os.fspath(file)!r} holds a value nested deeper than {MAX_DEPTH} levels "
            "(more than a checkpoint's state may be)",
            file=os.fspath(file),
        )
    if is_tensor_like(value) or isinstance(value, StoredTensor):
        return value.detach()
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, (float, str)):
        return value
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int)) else str(k): _plain(v, depth + 1, file) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1, file) for v in value]
    if hasattr(value, "__dict__") and type(value).__name__ == "AttributeBag":
        return _plain(vars(value), depth + 1, file)
    return repr(value)


def json_plain(value: Any, *, file: str | os.PathLike[str]) -> Any:
    """Like :func:`plain` but JSON only (for manifest metadata): tensors become lists of numbers."""
    return _json(plain(value, file=file))


def _json(value: Any) -> Any:
    """A :func:`plain` value (so of bounded depth) with its tensors as lists, non-finite floats as text."""
    if is_tensor_like(value) or isinstance(value, StoredTensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def count_stored(state: Any) -> int:
    """How many leaves of a state dict are still on disk (:mod:`.stored`)."""
    if isinstance(state, dict):
        return sum(count_stored(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(count_stored(v) for v in state)
    return 1 if is_stored(state) else 0
