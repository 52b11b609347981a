"""Where each group's tensors land in a ring buffer, and which byte ranges fill them.

Tensors of one group stored near each other in one file (within ``gap`` bytes) share one *span*:
the page-aligned range enclosing them is read in one go into a page-aligned place of the buffer, and
each tensor is a view at its offset inside it. Reading the aligned enclosing range, rather than the
exact bytes, lets every request go straight from the device into the buffer under O_DIRECT (no
staging copy), and puts each tensor at the same address modulo 4096 as its file offset. Only the
last page of a file may be partial: that range ends at the file's end. A tensor stored in several
pieces (a UCP checkpoint saved sharded) gets a region of its own, each run read into its place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from training.inference.sources import TensorSource, WeightSource

ALIGN = 4096
MERGE_GAP = 64 << 10  # bytes of unrelated data read through rather than starting a new span


def round_up(n: int, m: int = ALIGN) -> int:
    return (n + m - 1) // m * m


def round_down(n: int, m: int = ALIGN) -> int:
    return n // m * m


@dataclass(frozen=True)
class Placed:
    """Tensor ``name`` sits at bytes ``[at, at + nbytes)`` of the group's buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    at: int
    nbytes: int


@dataclass
class GroupLayout:
    """One group's buffer layout: reads per file as ``(file offset, buffer offset, length)``, tensor places."""

    label: str
    names: list[str]
    reads: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    tensors: list[Placed] = field(default_factory=list)
    nbytes: int = 0  # buffer bytes the group needs (a multiple of ALIGN)

    @property
    def read_bytes(self) -> int:
        return sum(n for lst in self.reads.values() for _, _, n in lst)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def largest(self) -> Placed:
        return max(self.tensors, key=lambda t: t.nbytes)


class FileSizes(dict[str, int]):
    """File sizes, looked up once each (``size``: of a local file by default; the source's ``files.size``
    for weights on an object store)."""

    def __init__(self, size: Callable[[str], int] = os.path.getsize) -> None:
        super().__init__()
        self._size = size

    def __missing__(self, path: str) -> int:
        size = self._size(path)
        self[path] = size
        return size


def layout_group(
    label: str, names: Sequence[str], source: WeightSource, sizes: FileSizes, gap: int = MERGE_GAP
) -> GroupLayout:
    g = GroupLayout(label, list(names))
    tensors = [source[n] for n in dict.fromkeys(names)]
    singles = sorted((t for t in tensors if t.single is not None), key=lambda t: (t.runs[0].file, t.runs[0].offset))
    span: list[TensorSource] = []
    for t in singles:
        run = t.runs[0]
        if span:
            last = span[-1].runs[0]
            end = max(s.runs[0].offset + s.runs[0].length for s in span)
            if last.file != run.file or round_down(run.offset) > round_up(end) + gap:
                _place_span(g, span, sizes)
                span = []
        span.append(t)
    if span:
        _place_span(g, span, sizes)
    for t in tensors:
        if t.single is None:
            at = g.nbytes
            for r in t.runs:
                g.reads.setdefault(r.file, []).append((r.offset, at + r.dst, r.length))
            g.tensors.append(Placed(t.name, t.dtype, t.shape, at, t.nbytes))
            g.nbytes = round_up(at + t.nbytes)
    return g


def _place_span(g: GroupLayout, span: list[TensorSource], sizes: FileSizes) -> None:
    file = span[0].runs[0].file
    lo = round_down(span[0].runs[0].offset)
    hi = max(t.runs[0].offset + t.runs[0].length for t in span)
    at = g.nbytes
    read_end = min(round_up(hi), sizes[file])
    g.reads.setdefault(file, []).append((lo, at, read_end - lo))
    for t in span:
        g.tensors.append(Placed(t.name, t.dtype, t.shape, at + t.runs[0].offset - lo, t.nbytes))
    g.nbytes = at + round_up(hi) - lo


def join_layouts(label: str, layouts: Sequence[GroupLayout]) -> GroupLayout:
    """One layout holding ``layouts`` one after another, each at its own page-aligned offset (their reads
    and tensor places shifted there): a part or a resident batch made of single tensors' layouts."""
    g = GroupLayout(label, [n for lay in layouts for n in lay.names])
    for lay in layouts:
        at = g.nbytes
        for file, reads in lay.reads.items():
            g.reads.setdefault(file, []).extend((off, at + b, n) for off, b, n in reads)
        g.tensors.extend(replace(t, at=at + t.at) for t in lay.tensors)
        g.nbytes = at + lay.nbytes
    return g
