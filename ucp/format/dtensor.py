"""A DTensor's local shard as regions of its global tensor, and its placement as a dim pattern.

``torch.distributed.tensor.DTensor`` says where its data lives with a ``DeviceMesh`` and one
placement per mesh dimension. This module turns that into what UCP's format speaks: the boxes of
the global tensor that this rank's local tensor holds (one box for ``Shard``/``Replicate``, several
for ``_StridedShard``, none for an empty uneven shard), which copy of replicated data it is, and,
for the manifest's record, the placement in the pattern language of docs/patterns.md.

The index math is pure and follows torch's semantics, applied left to right over the mesh dims:

* ``Shard(d)`` on a mesh dim of ``n`` ranks: dim ``d``'s current local extent ``L`` is cut like
  ``torch.chunk`` (chunks of ``ceil(L / n)``, trailing ranks get fewer or none);
* ``_StridedShard(d, split_factor=f)`` (FSDP2 over a tensor-parallel dim): the extent is first cut
  into ``f`` chunks (``torch.chunk``), each chunk is cut over the ``n`` ranks, and the rank holds
  its share of every chunk, concatenated;
* ``Replicate()``: every rank of the mesh dim holds the same data; ``Partial()`` holds unreduced
  partial values, which are not the tensor's values: callers refuse it.

``torch.distributed.tensor`` is never imported here: where it was not imported, no DTensor exists.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal, Sequence

from reshard.box import Box

if TYPE_CHECKING:
    import torch

Run = tuple[int, int]  # (global start, length) of consecutive elements of one dim, in local order
Kind = Literal["shard", "strided", "replicate", "partial", "unknown"]


@dataclass(frozen=True)
class Spec:
    """One mesh dim's placement, as plain data: ``dim`` and ``split_factor`` for the shard kinds."""

    kind: Kind
    dim: int = -1
    split_factor: int = 1
    text: str = ""  # torch's repr, for messages and the manifest's record


def dtensor_type() -> type | None:
    """torch's DTensor class if torch.distributed.tensor was imported, else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(obj: object) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(obj, cls)


def spec_of(placement: Any) -> Spec:
    """A torch placement as a :class:`Spec` (``_StridedShard`` checked first: in some torch versions it
    subclasses ``Shard``)."""
    text = repr(placement)
    if type(placement).__name__ == "_StridedShard":
        return Spec("strided", int(placement.dim), int(placement.split_factor), text)
    if placement.is_shard():
        return Spec("shard", int(placement.dim), 1, text)
    if placement.is_replicate():
        return Spec("replicate", text=text)
    if placement.is_partial():
        return Spec("partial", text=text)
    return Spec("unknown", text=text)


# -- index math -----------------------------------------------------------------------------------


def _take(runs: Sequence[Run], lo: int, hi: int) -> list[Run]:
    """Elements ``[lo, hi)`` of the concatenation of ``runs``, as runs."""
    out: list[Run] = []
    pos = 0
    for start, n in runs:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((start + a - pos, b - a))
        pos += n
        if pos >= hi:
            break
    return out


def _chunk(length: int, n: int, c: int) -> tuple[int, int]:
    """``torch.chunk``'s share of rank ``c`` of ``n`` in ``length`` elements: ``[lo, hi)``."""
    size = -(-length // n)
    lo = min(c * size, length)
    return lo, min(lo + size, length)


def _merge(runs: Sequence[Run]) -> list[Run]:
    out: list[Run] = []
    for start, n in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return out


def dim_runs(size: int, steps: Sequence[tuple[Spec, int, int]]) -> list[Run]:
    """The global indices one dim of ``size`` keeps after the shard ``steps`` (spec, mesh dim size,
    this rank's coordinate on it), in mesh-dim order: runs of consecutive global indices, in local order."""
    runs: list[Run] = [(0, size)] if size else []
    for spec, n, c in steps:
        length = sum(r[1] for r in runs)
        if spec.kind == "shard":
            runs = _take(runs, *_chunk(length, n, c))
        else:  # strided: its share of each of split_factor chunks
            first = -(-length // spec.split_factor)
            out: list[Run] = []
            for i in range(spec.split_factor):
                fs = min(first * i, length)
                fe = min(fs + first, length)
                lo, hi = _chunk(fe - fs, n, c)
                out.extend(_take(runs, fs + lo, fs + hi))
            runs = out
        runs = _merge(runs)
    return runs


def local_regions(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], specs: Sequence[Spec]
) -> tuple[tuple[int, ...], list[tuple[Box, Box]]]:
    """The local shape and the ``(local box, global box)`` pairs of the rank at mesh ``coord``.

    The pairs tile the local tensor exactly (boxes with no elements left out); specs must be
    shard or replicate kinds.
    """
    per_dim: list[list[Run]] = []
    for d, size in enumerate(global_shape):
        steps = [
            (s, mesh_shape[m], coord[m]) for m, s in enumerate(specs) if s.kind in ("shard", "strided") and s.dim == d
        ]
        per_dim.append(dim_runs(int(size), steps))
    local_shape = tuple(sum(r[1] for r in runs) for runs in per_dim)
    pairs: list[tuple[Box, Box]] = []
    if math.prod(local_shape) == 0:
        return local_shape, pairs
    with_local = []
    for runs in per_dim:
        pos, rows = 0, []
        for start, n in runs:
            rows.append((pos, start, n))
            pos += n
        with_local.append(rows)
    for combo in itertools.product(*with_local):
        pairs.append(
            (
                Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo)),
                Box(tuple(r[1] for r in combo), tuple(r[2] for r in combo)),
            )
        )
    return local_shape, pairs


def replica_index(mesh_shape: Sequence[int], coord: Sequence[int], specs: Sequence[Spec]) -> int:
    """Which copy of its data this rank holds: its mixed-radix index over the ``Replicate`` mesh dims
    (0 writes it on save)."""
    index = 0
    for m, s in enumerate(specs):
        if s.kind == "replicate":
            index = index * mesh_shape[m] + coord[m]
    return index


# -- the record in the pattern language -------------------------------------------------------------


def pattern_axis(name: str | None, ndim: int) -> str:
    """The layout axis (tp, dp or ep) a mesh dim stands for: by its name (``tp``, ``dp_shard`` -> dp,
    ``ep``...), an unnamed 1-D mesh being data parallel (FSDP)."""
    if name is None:
        return "dp" if ndim == 1 else f"?{ndim}"
    low = name.lower()
    for axis in ("tp", "ep", "dp"):
        if low == axis or low.startswith(axis + "_") or low.endswith("_" + axis):
            return axis
    return "dp" if low in ("fsdp", "dp_shard", "hsdp", "data") else "?"


@lru_cache(maxsize=4096)
def dims_pattern(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    axes: tuple[str, ...],
    specs: tuple[Spec, ...],
) -> str | None:
    """The dim pattern (docs/patterns.md) giving every rank of the mesh the same regions as ``specs``,
    with mesh dim ``m`` written as axis ``axes[m]``; None when the language cannot say it (mesh dims
    sharing an axis, an uneven split of a split, a strided shard that is not FSDP-over-TP's).

    Each candidate is checked against :func:`dim_runs` at every coordinate of the mesh dims
    splitting that dim, through ``reshard``'s own resolver, so a recorded pattern is exact.
    """
    from reshard.errors import PatternError
    from reshard.pattern import parse_pattern
    from reshard.shard import split_dim

    used = [a for m, a in enumerate(axes) if specs[m].kind in ("shard", "strided")]
    if len(set(used)) != len(used) or any(a not in ("tp", "dp", "ep") for a in used):
        return None
    terms = []
    for d, size in enumerate(global_shape):
        mdims = [m for m, s in enumerate(specs) if s.kind in ("shard", "strided") and s.dim == d]
        if not mdims:
            terms.append(f"d{d}")
            continue
        found = None
        for order in (mdims, mdims[::-1]):  # left-to-right, or right-to-left (a strided shard's meaning)
            for opts in ("", " | uneven=ceil"):
                term = f"({' '.join(axes[m] for m in order)} d{d}{opts})"
                if _term_matches(term, size, mdims, mesh_shape, axes, specs, parse_pattern, split_dim, PatternError):
                    found = term
                    break
            if found:
                break
        if found is None:
            return None
        terms.append(found)
    return " ".join(terms)


def _term_matches(
    term: str,
    size: int,
    mdims: list[int],
    mesh_shape: Sequence[int],
    axes: Sequence[str],
    specs: Sequence[Spec],
    parse_pattern: Any,
    split_dim: Any,
    pattern_error: type[Exception],
) -> bool:
    dim = parse_pattern(term).dims[0]
    sizes = {axes[m]: mesh_shape[m] for m in mdims}
    for coords in itertools.product(*(range(mesh_shape[m]) for m in mdims)):
        index = {axes[m]: c for m, c in zip(mdims, coords)}
        try:
            share = split_dim(dim, size, sizes, index, "dim")
        except pattern_error:
            return False
        want = dim_runs(size, [(specs[m], mesh_shape[m], c) for m, c in zip(mdims, coords)])
        got = [(g, n) for _, g, n in share.runs]
        if got != want:
            return False
    return True


# -- a DTensor, read ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DTensorView:
    """What UCP needs of one DTensor: its local tensor (the real memory), global shape, mesh and placements."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...] | None
    mesh_ranks: tuple[int, ...]  # global ranks of the mesh, row-major
    coord: tuple[int, ...] | None  # None: this rank is not in the mesh
    specs: tuple[Spec, ...]

    @property
    def placements_text(self) -> list[str]:
        return [s.text for s in self.specs]

    def regions(self) -> list[tuple[Box, Box]]:
        """``(local box, global box)`` of every non-empty region this rank holds (none outside the mesh).

        Raises ValueError when torch's local tensor does not have the shape the placements give
        (a placement this code reads differently from torch): better refused than saved wrong.
        """
        if self.coord is None:
            return []
        shape, pairs = local_regions(self.global_shape, self.mesh_shape, self.coord, self.specs)
        if shape != tuple(self.local.shape):
            raise ValueError(
                f"placements {self.placements_text} on mesh {list(self.mesh_shape)} give rank {list(self.coord)} "
                f"a local shape {list(shape)}, but its local tensor has shape {list(self.local.shape)}"
            )
        return pairs

    def replica(self) -> int:
        return 0 if self.coord is None else replica_index(self.mesh_shape, self.coord, self.specs)

    def record(self) -> dict[str, Any]:
        """The manifest's record of this placement (docs/format.md, conventional metadata ``dtensor``)."""
        names = self.mesh_names or tuple(f"dim{i}" for i in range(len(self.mesh_shape)))
        axes = tuple(
            pattern_axis(self.mesh_names[m] if self.mesh_names else None, len(self.mesh_shape))
            for m in range(len(self.mesh_shape))
        )
        pattern = dims_pattern(self.global_shape, self.mesh_shape, axes, self.specs)
        used = {axes[m]: names[m] for m, s in enumerate(self.specs) if s.kind in ("shard", "strided")}
        return {
            "mesh": dict(zip(names, self.mesh_shape)),
            "placements": self.placements_text,
            "dims": pattern,
            "axes": used if pattern is not None else {},
        }


def view_of(dt: Any) -> DTensorView:
    """Read a DTensor (or an ``nn.Parameter`` wrapping one) without communicating."""
    mesh = dt.device_mesh
    local = dt._local_tensor  # the memory itself: to_local() is an autograd op on parameters
    coord = mesh.get_coordinate()
    names = getattr(mesh, "mesh_dim_names", None)
    return DTensorView(
        local=local.detach() if local.requires_grad else local,
        global_shape=tuple(int(d) for d in dt.shape),
        mesh_shape=tuple(int(d) for d in mesh.mesh.shape),
        mesh_names=tuple(names) if names else None,
        mesh_ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
        coord=tuple(int(c) for c in coord) if coord is not None else None,
        specs=tuple(spec_of(p) for p in dt.placements),
    )
