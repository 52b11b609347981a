"""The exact-cover check scales with the number of pieces (no quadratic sweep on any input) and
still finds every overlap and gap: checked against a brute-force count of every element."""

from __future__ import annotations

import math
import random
from datetime import datetime, timezone

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard.box as box_mod
from reshard.box import Box, FlatRange, Region, check_exact_cover
from ucp.errors import ManifestError
from ucp.format.manifest import FORMAT_VERSION, FileInfo, Manifest, Piece, TensorEntry, Topology, parse_manifest


def _brute(regions: list[Region], shape: tuple[int, ...]) -> tuple[bool, bool]:
    """(some element is held twice or more, some element is held by none), by counting each one."""
    counts = np.zeros(shape, dtype=np.int64)
    flat = counts.reshape(-1)
    for r in regions:
        if isinstance(r, FlatRange):
            flat[r.start : r.stop] += 1
        else:
            counts[r.slices()] += 1
    return bool((counts > 1).any()), bool((counts == 0).any())


def _guillotine(rng: random.Random, box: Box, depth: int) -> list[Box]:
    """A random tiling of ``box``: cut it along a random dimension, recursively."""
    cuttable = [d for d, n in enumerate(box.shape) if n > 1]
    if depth == 0 or not cuttable or rng.random() < 0.2:
        return [box]
    d = rng.choice(cuttable)
    at = rng.randint(1, box.shape[d] - 1)
    lo = Box(box.offsets, box.shape[:d] + (at,) + box.shape[d + 1 :])
    hi = Box(
        box.offsets[:d] + (box.offsets[d] + at,) + box.offsets[d + 1 :],
        box.shape[:d] + (box.shape[d] - at,) + box.shape[d + 1 :],
    )
    return _guillotine(rng, lo, depth - 1) + _guillotine(rng, hi, depth - 1)


def _perturb(rng: random.Random, regions: list[Region], shape: tuple[int, ...]) -> list[Region]:
    """The tiling, possibly broken: a piece dropped, duplicated, grown, shrunk or moved."""
    regions = list(regions)
    kind = rng.choice(["none", "drop", "dup", "grow", "shrink", "move", "flat"])
    if not regions or kind == "none":
        return regions
    i = rng.randrange(len(regions))
    r = regions[i]
    if kind == "drop":
        del regions[i]
    elif kind == "dup":
        regions.insert(rng.randrange(len(regions) + 1), r)
    elif kind == "flat":
        total = math.prod(shape)
        a = rng.randint(0, total)
        regions.append(FlatRange(a, rng.randint(a, total)))
    elif isinstance(r, Box) and r.ndim:
        d = rng.randrange(r.ndim)
        off, n = list(r.offsets), list(r.shape)
        if kind == "grow" and off[d] + n[d] < shape[d]:
            n[d] += 1
        elif kind == "shrink" and n[d] > 0:
            n[d] -= 1
        elif kind == "move" and off[d] + n[d] < shape[d]:
            off[d] += 1
        regions[i] = Box(tuple(off), tuple(n))
    return regions


def _flat_partition(rng: random.Random, total: int) -> list[Region]:
    cuts = sorted(rng.sample(range(1, total), min(total - 1, rng.randint(0, 6)))) if total > 1 else []
    edges = [0, *cuts, total]
    return [FlatRange(a, b) for a, b in zip(edges, edges[1:])]


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ndim=st.integers(0, 4), flat=st.booleans())
def test_exact_cover_agrees_with_brute_force(seed: int, ndim: int, flat: bool) -> None:
    _check_one_case(seed, ndim, flat)


def test_without_the_corner_test_the_sweep_alone_agrees_with_brute_force(monkeypatch: pytest.MonkeyPatch) -> None:
    # the path taken when pieces split too many dimensions to list their corners
    monkeypatch.setattr(box_mod, "CORNER_BUDGET", 0)
    for seed in range(300):
        _check_one_case(seed, seed % 5, seed % 3 == 0)


def _check_one_case(seed: int, ndim: int, flat: bool) -> None:
    rng = random.Random(seed)
    shape = tuple(rng.randint(0, 5) for _ in range(ndim))
    full = Box((0,) * ndim, shape)
    regions: list[Region] = _flat_partition(rng, math.prod(shape)) if flat else list(_guillotine(rng, full, 6))
    rng.shuffle(regions)
    regions = _perturb(rng, regions, shape)
    overlap, gap = _brute(regions, shape)
    why = check_exact_cover(regions, shape)
    if not overlap and not gap:
        assert why is None
    elif overlap:
        assert why is not None and why.startswith("pieces ") and why.endswith(" overlap"), (regions, shape, why)
        a, b = (int(k) for k in why.removeprefix("pieces ").removesuffix(" overlap").split(" and "))
        assert a != b and _brute([regions[a], regions[b]], shape)[0], f"{why}, but they share no element"
    else:
        assert why is not None and f"of {math.prod(shape)} elements" in why, (regions, shape, why)


def test_overlap_names_the_two_pieces() -> None:
    tiles = [Box((i, j), (1, 1)) for i in range(100) for j in range(100)]
    tiles.append(Box((42, 7), (1, 2)))
    assert check_exact_cover(tiles, (100, 100)) == f"pieces {42 * 100 + 7} and {len(tiles) - 1} overlap"
    del tiles[5]
    tiles.pop()
    assert check_exact_cover(tiles, (100, 100)) == "pieces cover 9999 of 10000 elements"


@pytest.mark.timeout(60)
def test_40k_single_element_pieces_parse() -> None:
    n = 200
    pieces = [
        Piece.from_region(
            Box((i, j), (1, 1)),
            file="rank-00000.safetensors",
            offset=4096 + 4 * (i * n + j),
            length=4,
            crc32c=0,
            entry=f"w#{i * n + j}" if i * n + j else None,
        )
        for i in range(n)
        for j in range(n)
    ]
    manifest = Manifest.model_construct(
        format_version=FORMAT_VERSION,
        creator="test",
        created=datetime(2026, 1, 1, tzinfo=timezone.utc),
        step=1,
        topology=Topology(world_size=1),
        files={"rank-00000.safetensors": FileInfo(rank=0, size=4096 + 4 * n * n)},
        tensors={"w": TensorEntry.model_construct(dtype="F32", shape=[n, n], pieces=pieces)},
        state={"dict": {"w": {"tensor": "w"}}},
        metadata={},
    )
    parsed = parse_manifest(manifest.to_json())
    assert len(parsed.tensors["w"].pieces) == n * n
    # one piece moved onto its neighbour: found, and named
    broken = manifest.model_copy(deep=True)
    broken.tensors["w"].pieces[-1].box.offsets = [n - 1, n - 2]  # type: ignore[union-attr]
    with pytest.raises(
        ManifestError, match=rf"tensor 'w'.*piece {n * n - 2} \(in .*\) and piece {n * n - 1} .* overlap"
    ):
        parse_manifest(broken.to_json())


@pytest.mark.timeout(60)
def test_hostile_staircase_of_90k_pieces_is_settled_quickly() -> None:
    # column k holds rows [k, n): no two pieces overlap, every one spans the sweep line, half the
    # elements are missing. A pairwise sweep would compare ~n**2 / 2 = 4e9 pairs.
    n = 90_000
    stairs = [Box((k, k), (n - k, 1)) for k in range(n)]
    assert check_exact_cover(stairs, (n, n)) == f"pieces cover {n * (n + 1) // 2} of {n * n} elements"
    # and the same with two of them overlapping: named, without comparing every pair
    stairs.append(Box((n - 1, 0), (1, 1)))
    assert check_exact_cover(stairs, (n, n)) == f"pieces 0 and {n} overlap"
