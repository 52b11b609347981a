"""A numpy simulation of save and load, to test layouts and plans without torch or files.

* ``global_arrays``: distinct non-zero values for every element of every tensor (0 means "padding").
* ``fill``: a buffer's expected local array, written through its slots.
* ``save``: what every rank writes (replica 0 only) into fake files (bytearrays), as SourcePieces.
* ``execute``: run a Plan, refusing double writes and checking that fills cover exactly the rest.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from reshard import Box, FlatRange, LocalBuffer, Plan, SourcePiece

DTYPE = np.dtype("<i4")


def global_arrays(shapes: Mapping[str, Sequence[int]], base: int = 1) -> dict[str, np.ndarray]:
    """Every element of every tensor a distinct positive int32 (so misplaced data never compares equal)."""
    out, pos = {}, base
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = np.arange(pos, pos + n, dtype=DTYPE).reshape(shape)
        pos += n
    return out


def region_values(arr: np.ndarray, region: Box | FlatRange) -> np.ndarray:
    """A region's elements of ``arr``, 1-d, in the region's order."""
    if isinstance(region, Box):
        return arr[region.slices()].reshape(-1)
    return arr.reshape(-1)[region.start : region.stop]


def put(buf_arr: np.ndarray, region: Box | FlatRange, values: np.ndarray) -> None:
    if isinstance(region, Box):
        buf_arr[region.slices()] = values.reshape(region.shape)
    else:
        buf_arr.reshape(-1)[region.start : region.stop] = values


def fill(buf: LocalBuffer, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The local array a buffer should hold: its slots' global regions, zero elsewhere."""
    out = np.zeros(buf.shape, dtype=DTYPE)
    for s in buf.slots:
        put(out, s.local, region_values(arrays[s.tensor], s.glob))
    return out


def save(
    ranks: Sequence[tuple[str, Sequence[LocalBuffer], Mapping[str, np.ndarray]]],
) -> tuple[dict[str, bytearray], dict[str, list[SourcePiece]]]:
    """Each (file name, buffers, local arrays by buffer name) writes its replica-0 slots to its file."""
    files: dict[str, bytearray] = {}
    sources: dict[str, list[SourcePiece]] = {}
    for fname, buffers, data in ranks:
        f = files.setdefault(fname, bytearray())
        for buf in buffers:
            for s in buf.slots:
                if s.replica:
                    continue
                vals = region_values(data[buf.name], s.local)
                sources.setdefault(s.tensor, []).append(SourcePiece(fname, len(f), s.glob, DTYPE.itemsize))
                f += vals.astype(DTYPE).tobytes()
    return files, sources


def execute(p: Plan, files: Mapping[str, bytes]) -> dict[str, np.ndarray]:
    """Run a plan; every target element must be written exactly once, by a copy or a fill."""
    out = {name: np.full(shape, -1, dtype=DTYPE) for name, shape in p.shapes.items()}
    writes = {name: np.zeros(math.prod(shape), dtype=np.int32) for name, shape in p.shapes.items()}
    for c in p.copies:
        assert c.nbytes == c.count * DTYPE.itemsize
        vals = np.frombuffer(bytes(files[c.file][c.offset : c.offset + c.nbytes]), dtype=DTYPE)
        out[c.target].reshape(-1)[c.start : c.start + c.count] = vals
        writes[c.target][c.start : c.start + c.count] += 1
    for f in p.fills:
        out[f.target].reshape(-1)[f.start : f.start + f.count] = 0
        writes[f.target][f.start : f.start + f.count] += 1
    for name, w in writes.items():
        assert (w == 1).all(), f"buffer {name}: elements written {sorted(set(w.tolist()))} times"
    return out
