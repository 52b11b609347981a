"""The regions a DTensor's local shard holds (ucp.format.dtensor) agree with torch's own placement math,
and the recorded dim patterns resolve, through reshard, to exactly those regions."""

from __future__ import annotations

import itertools

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

from reshard.box import Box
from reshard.pattern import parse_pattern
from reshard.shard import shard
from ucp.format.dtensor import dims_pattern, local_regions, replica_index, spec_of

# (global shape, mesh shape, placements): FSDP2 (even, uneven, empty shards), TP, FSDP x TP
# (_StridedShard, as fully_shard makes it over a colwise-parallel weight), HSDP, Shard twice on one dim.
CASES = [
    ((8, 5), (2,), [Shard(0)]),
    ((5, 8), (4,), [Shard(0)]),  # 2, 2, 1, 0 rows
    ((3, 2), (4,), [Shard(0)]),  # 1, 1, 1, 0
    ((6, 7), (2, 2), [Shard(0), Shard(1)]),
    ((8, 5), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((10, 3), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # uneven strided
    ((9, 4), (3, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((5, 8), (2, 2), [Shard(0), Shard(1)]),
    ((7, 2), (2, 2), [Shard(0), Shard(0)]),  # uneven split of a split
    ((8, 4), (2, 2), [Shard(0), Shard(0)]),
    ((6, 4), (2, 3), [Replicate(), Shard(0)]),  # HSDP
    ((4,), (2, 2), [Shard(0), Replicate()]),
    ((), (2,), [Replicate()]),
]


def _torch_indices(size: int, steps: list[tuple[object, int, int]]) -> list[int]:
    """Global indices of one dim after torch's own per-placement math, composed left to right."""
    idx = list(range(size))
    for p, n, c in steps:
        if isinstance(p, _StridedShard):
            _, offs = p._local_shard_size_and_offset(len(idx), n, c, offset_mode=_StridedShardOffsetMode.ALL)
            assert isinstance(offs, list)
            idx = [idx[i] for i in offs]
        else:
            k, off = Shard._local_shard_size_and_offset(p, len(idx), n, c)  # type: ignore[arg-type]
            idx = idx[off : off + k]
    return idx


@pytest.mark.parametrize("shape,mesh,placements", CASES, ids=[str(i) for i in range(len(CASES))])
def test_regions_match_torch(shape: tuple[int, ...], mesh: tuple[int, ...], placements: list) -> None:
    specs = [spec_of(p) for p in placements]
    covered: dict[tuple[int, ...], int] = {}
    for coord in itertools.product(*(range(n) for n in mesh)):
        local_shape, pairs = local_regions(shape, mesh, coord, specs)
        torch_shape, torch_offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
        assert local_shape == tuple(torch_shape), coord
        want = [
            _torch_indices(size, [(p, mesh[m], coord[m]) for m, p in enumerate(placements) if _shards(p, d)])
            for d, size in enumerate(shape)
        ]
        if all(want):
            assert tuple(w[0] for w in want) == tuple(torch_offset), coord
        # every local element maps to the global element torch says, exactly once
        got: dict[tuple[int, ...], tuple[int, ...]] = {}
        for lbox, gbox in pairs:
            for lo in itertools.product(*(range(o, o + n) for o, n in zip(lbox.offsets, lbox.shape))):
                g = tuple(go + (li - lo_) for go, li, lo_ in zip(gbox.offsets, lo, lbox.offsets))
                assert lo not in got
                got[lo] = g
        expect = {lo: tuple(w[i] for w, i in zip(want, lo)) for lo in itertools.product(*(range(len(w)) for w in want))}
        assert got == expect, coord
        if replica_index(mesh, coord, specs) == 0:
            for g in got.values():
                covered[g] = covered.get(g, 0) + 1
    # the replica-0 regions of all ranks tile the tensor exactly once
    assert covered == {g: 1 for g in itertools.product(*(range(n) for n in shape))}


def _shards(p: object, d: int) -> bool:
    return isinstance(p, (Shard, _StridedShard)) and p.dim == d


@pytest.mark.parametrize(
    "shape,mesh,axes,placements,pattern",
    [
        ((8, 5), (2,), ("dp",), [Shard(0)], "(dp d0) d1"),
        ((5, 8), (4,), ("dp",), [Shard(0)], "(dp d0 | uneven=ceil) d1"),
        ((8, 5), (2, 2), ("dp", "tp"), [_StridedShard(0, split_factor=2), Shard(0)], "(tp dp d0) d1"),
        ((5, 8), (2, 2), ("dp", "tp"), [Shard(0), Shard(1)], "(dp d0 | uneven=ceil) (tp d1)"),
        ((8, 4), (2, 2), ("dp", "tp"), [Shard(0), Shard(0)], "(dp tp d0) d1"),
        ((6, 4), (2, 3), ("dp", "dp"), [Replicate(), Shard(0)], "(dp d0) d1"),  # HSDP: dp_replicate, dp_shard
        ((10, 3), (2, 2), ("dp", "tp"), [_StridedShard(0, split_factor=2), Shard(0)], None),  # 3,2,3,2: no pattern
        ((7, 2), (2, 2), ("dp", "tp"), [Shard(0), Shard(0)], "(dp tp d0 | uneven=ceil) d1"),  # 2,2 + 2,1: as one
        ((5, 2), (2, 2), ("dp", "tp"), [Shard(0), Shard(0)], None),  # 3 -> 2,1 and 2 -> 1,1: not as one
        ((6, 7), (2, 2), ("dp", "dp"), [Shard(0), Shard(1)], None),  # one axis cannot split two dims
    ],
)
def test_recorded_pattern(
    shape: tuple[int, ...], mesh: tuple[int, ...], axes: tuple[str, ...], placements: list, pattern: str | None
) -> None:
    specs = tuple(spec_of(p) for p in placements)
    assert dims_pattern(shape, mesh, axes, specs) == pattern
    if pattern is None:
        return
    parsed = parse_pattern(pattern)
    for coord in itertools.product(*(range(n) for n in mesh)):
        sizes = {axes[m]: mesh[m] for m, s in enumerate(specs) if s.kind != "replicate"}
        index = {axes[m]: coord[m] for m, s in enumerate(specs) if s.kind != "replicate"}
        _, pairs = shard(parsed, shape, sizes, index)
        _, ours = local_regions(shape, mesh, coord, specs)
        assert _cells(g for _, g in pairs) == _cells(g for _, g in ours), coord


def _cells(boxes: object) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    for b in boxes:  # type: ignore[attr-defined]
        assert isinstance(b, Box)
        out.update(itertools.product(*(range(o, o + n) for o, n in zip(b.offsets, b.shape))))
    return out
