"""Contiguity: cutting boxes into row-major-contiguous pieces and runs of elements.

Bytes move in contiguous runs. A box of a bigger array is contiguous in memory only when it has
the form (1, ..., 1, k, full, ..., full); anything else is a set of such pieces, one per index
of the leading dimensions. Used by ZeRO (flat ranges of local tensors to global regions) and the
planner (copies between a stored piece and a target buffer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

from .box import Box


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a row-major array of ``shape``."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def contiguous_boxes(box: Box, shape: Sequence[int]) -> list[Box]:
    """``box`` cut into sub-boxes each contiguous in the row-major order of an array of ``shape``, in order."""
    if box.empty:
        return []
    nd = len(shape)
    if nd == 0:
        return [box]
    j = nd - 1
    while j > 0 and box.shape[j] == shape[j]:
        j -= 1
    lead = [range(box.offsets[m], box.stop[m]) for m in range(j)]
    tail_off, tail_shape = box.offsets[j:], box.shape[j:]
    return [Box(tuple(idx) + tail_off, (1,) * j + tail_shape) for idx in itertools.product(*lead)]


@dataclass(frozen=True)
class Affine:
    """Where the elements of a box live in a 1-d buffer: ``base + Σ (index - origin) · strides``."""

    base: int
    origin: tuple[int, ...]
    strides: tuple[int, ...]

    def at(self, index: Sequence[int]) -> int:
        return self.base + sum((i - o) * s for i, o, s in zip(index, self.origin, self.strides))


def runs(box: Box, src: Affine, dst: Affine) -> Iterator[tuple[int, int, int]]:
    """``(src position, dst position, count)`` runs copying ``box`` (global coordinates) between two layouts.

    Trailing dimensions merge into one run as long as both sides stay contiguous across them.
    """
    if box.empty:
        return
    dims = [d for d in range(box.ndim) if box.shape[d] != 1]  # size-1 dims never break contiguity
    count = 1
    inner = len(dims)
    expect_s = expect_d = 1
    while inner > 0:
        d = dims[inner - 1]
        if src.strides[d] != expect_s or dst.strides[d] != expect_d:
            break
        count *= box.shape[d]
        expect_s = expect_d = count
        inner -= 1
    lead = dims[:inner]
    ranges = [range(box.offsets[d], box.stop[d]) for d in lead]
    index = list(box.offsets)
    for idx in itertools.product(*ranges):
        for d, v in zip(lead, idx):
            index[d] = v
        yield src.at(index), dst.at(index), count
