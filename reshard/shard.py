"""Apply a parsed pattern to one tensor and one mesh coordinate: the local shape and its boxes.

Each dimension is resolved on its own into *runs* (local start, global start, length); the
tensor's boxes are the Cartesian product of its dimensions' runs. A plain split gives one run,
fused parts one per part, a padded shard its real rows only (the rest of the local extent is
padding that maps to nothing).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .box import Box
from .errors import PatternError
from .pattern import Dim, Pattern, part_sizes

Run = tuple[int, int, int]  # (local start, global start, length)


@dataclass(frozen=True)
class DimShare:
    """What one rank holds of one dimension: the local extent and the runs that carry data."""

    local_size: int
    runs: tuple[Run, ...]


def _axes_text(dim: Dim, sizes: Mapping[str, int]) -> str:
    return "×".join(dim.axes) + "=" + "×".join(str(sizes[a]) for a in dim.axes)


def split_dim(dim: Dim, total: int, sizes: Mapping[str, int], index: Mapping[str, int], where: str) -> DimShare:
    """Resolve one dimension of global size ``total``; ``where`` names it in errors ("dim 0")."""
    if dim.size is not None and dim.size != total:
        raise PatternError(
            f"{where} is declared {dim.label}:{dim.size} but the tensor's size is {total}", span=dim.span
        )
    if not dim.axes:
        return DimShare(total, ((0, 0, total),) if total else ())
    k = math.prod(sizes[a] for a in dim.axes)
    t = 0
    for a in dim.axes:  # mixed radix, first axis most significant
        t = t * sizes[a] + index[a]
    if dim.parts is not None:
        return _split_fused(dim, total, k, t, sizes, where)
    if dim.pad is not None:
        padded = -(-total // (dim.pad * k)) * dim.pad * k
        local = padded // k
        real = max(0, min(local, total - t * local))
        return DimShare(local, ((0, t * local, real),) if real else ())
    if total % dim.unit:
        raise PatternError(f"{where} has size {total}, not a multiple of unit={dim.unit}", span=dim.span)
    n = total // dim.unit
    if dim.uneven is None:
        if n % k:
            what = f"{n} units of {dim.unit}" if dim.unit > 1 else f"size {total}"
            raise PatternError(
                f"{where} has {what}, not divisible by {_axes_text(dim, sizes)}; "
                "allow it with '| uneven' or pad it with '| pad=N'",
                span=dim.span,
            )
        start, count = t * (n // k), n // k
    elif dim.uneven == "first":
        q, r = divmod(n, k)
        start, count = t * q + min(t, r), q + (1 if t < r else 0)
    else:  # ceil
        c = -(-n // k)
        start = min(t * c, n)
        count = min((t + 1) * c, n) - start
    local = count * dim.unit
    return DimShare(local, ((0, start * dim.unit, local),) if local else ())


def _split_fused(dim: Dim, total: int, k: int, t: int, sizes: Mapping[str, int], where: str) -> DimShare:
    assert dim.parts is not None
    psizes = part_sizes(dim, total)
    if psizes is None:
        given = " ".join(f"{p.name}:{p.size}" if p.size is not None else p.name for p in dim.parts)
        raise PatternError(f"{where} has size {total}, which the parts [{given}] do not add up to", span=dim.span)
    runs: list[Run] = []
    local = glob = 0
    for part, size in zip(dim.parts, psizes):
        if size % dim.unit:
            raise PatternError(
                f"{where}: part {part.name!r} has size {size}, not a multiple of unit={dim.unit}", span=part.span
            )
        n = size // dim.unit
        if n % k:
            what = f"{n} units of {dim.unit}" if dim.unit > 1 else f"size {size}"
            raise PatternError(
                f"{where}: part {part.name!r} has {what}, not divisible by {_axes_text(dim, sizes)}", span=part.span
            )
        share = size // k
        if share:
            runs.append((local, glob + t * share, share))
        local += share
        glob += size
    return DimShare(local, tuple(runs))


def shard(
    pattern: Pattern, shape: Sequence[int], sizes: Mapping[str, int], index: Mapping[str, int]
) -> tuple[tuple[int, ...], list[tuple[Box, Box]]]:
    """The local shape and the ``(local box, global box)`` pairs of one rank's shard.

    ``sizes``/``index``: the count and this rank's index for every axis the pattern uses.
    Raises PatternError (without tensor context; the caller adds it).
    """
    shape = tuple(int(d) for d in shape)
    if not pattern.fits_rank(len(shape)):
        want = f"{len(pattern.dims)}" + (" or more" if pattern.ellipsis is not None else "")
        raise PatternError(f"the pattern has {want} dims but the tensor has shape {list(shape)} ({len(shape)} dims)")
    dims = pattern.expand(len(shape))
    shares = [split_dim(d, n, sizes, index, f"dim {i}") for i, (d, n) in enumerate(zip(dims, shape))]
    local_shape = tuple(s.local_size for s in shares)
    pairs = []
    for combo in itertools.product(*(s.runs for s in shares)):
        lbox = Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo))
        gbox = Box(tuple(r[1] for r in combo), tuple(r[2] for r in combo))
        pairs.append((lbox, gbox))
    return local_shape, pairs
