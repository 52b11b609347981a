"""Box and flat-range math, checked against numpy indexing on small arrays."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.box import (
    Box,
    FlatRange,
    check_exact_cover,
    element_span,
    flat_index,
    flat_range_to_boxes,
    flat_span,
    intersect_ranges,
    region_blocks,
    transfers,
    unflatten_index,
)


def test_intersect_and_contains():
    a = Box.of((0, 2), (4, 4))
    b = Box.of((2, 0), (4, 3))
    assert a.intersect(b) == Box.of((2, 2), (2, 1))
    assert a.intersect(Box.of((4, 0), (1, 1))) is None  # touching is not overlapping
    assert a.contains(Box.of((1, 3), (2, 2)))
    assert not a.contains(b)
    assert Box.of((), ()).intersect(Box.of((), ())) == Box.of((), ())  # 0-d: one element
    assert Box.of((0,), (0,)).intersect(Box.of((0,), (5,))) is None  # empty boxes meet nothing
    with pytest.raises(ValueError):
        a.intersect(Box.of((0,), (1,)))


def test_within_and_slices():
    assert Box.of((1, 1), (2, 3)).within((3, 4))
    assert not Box.of((1, 2), (2, 3)).within((3, 4))
    assert not Box.of((-1, 0), (1, 1)).within((3, 4))
    arr = np.arange(12).reshape(3, 4)
    assert arr[Box.of((1, 1), (2, 2)).slices()].tolist() == [[5, 6], [9, 10]]


def test_flat_index_round_trip():
    shape = (3, 4, 5)
    for pos in range(60):
        assert flat_index(shape, unflatten_index(shape, pos)) == pos


def test_flat_span_of_column_block():
    # columns 1..2 of a 3x4 array: first element (0,1)=1, last (2,2)=10
    assert flat_span((3, 4), Box.of((0, 1), (3, 2))) == (1, 11)
    assert flat_span((3, 4), Box.of((0, 0), (0, 2))) == (0, 0)


def _elements(boxes, shape):
    arr = np.arange(math.prod(shape)).reshape(shape)
    out = []
    for b in boxes:
        out.extend(arr[b.slices()].reshape(-1).tolist())
    return out


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (2, 1, 3, 2), ()])
def test_flat_range_to_boxes_is_exact_and_contiguous(shape):
    n = math.prod(shape)
    for start, stop in itertools.combinations_with_replacement(range(n + 1), 2):
        parts = flat_range_to_boxes(start, stop, shape)
        assert _elements([b for _, b in parts], shape) == list(range(start, stop))
        for first, box in parts:  # each box is one contiguous run starting at `first`
            lo, hi = flat_span(shape, box)
            assert lo == first and hi - lo == box.numel
        assert len(parts) <= max(1, 2 * len(shape) - 1)


def test_intersect_ranges():
    assert intersect_ranges((0, 5), (3, 9)) == (3, 5)
    assert intersect_ranges((0, 3), (3, 9)) is None


def _region_elements(region, shape):
    """Global flat indices of a region's buffer, in buffer order."""
    arr = np.arange(math.prod(shape)).reshape(shape)
    if isinstance(region, FlatRange):
        return list(range(region.start, region.stop))
    return arr[region.slices()].reshape(-1).tolist()


regions_2d = st.one_of(
    st.builds(
        lambda r0, c0, r, c: Box.of((r0, c0), (r, c)),
        st.integers(0, 3),
        st.integers(0, 4),
        st.integers(0, 3),
        st.integers(0, 3),
    ),
    st.builds(lambda a, b: FlatRange(min(a, b), max(a, b)), st.integers(0, 35), st.integers(0, 35)),
)


@given(regions_2d, regions_2d)
@settings(max_examples=300, deadline=None)
def test_transfers_move_exactly_the_shared_elements(src, dst):
    shape = (6, 6)
    src_el, dst_el = _region_elements(src, shape), _region_elements(dst, shape)
    if isinstance(src, Box) and not src.within(shape) or isinstance(dst, Box) and not dst.within(shape):
        return
    moved = []
    src_buf = np.array(src_el)
    dst_buf = np.full(len(dst_el), -1)
    for t in transfers(src, dst, shape):
        s_off, s_box = t.src_block
        d_off, d_box = t.dst_block
        s = src_buf[s_off : s_off + s_box.numel].reshape(s_box.shape)[t.box.relative_to(s_box).slices()]
        d = dst_buf[d_off : d_off + d_box.numel].reshape(d_box.shape)
        d[t.box.relative_to(d_box).slices()] = s
        moved.extend(s.reshape(-1).tolist())
    shared = set(src_el) & set(dst_el)
    assert sorted(moved) == sorted(shared)
    for i, g in enumerate(dst_el):  # every shared element landed at its own place
        assert dst_buf[i] == (g if g in shared else -1)


def test_element_span_of_flat_region():
    region = FlatRange(3, 15)  # of a 4x5 array
    box = Box.of((1, 0), (1, 5))  # row 1 = elements 5..9 -> region buffer 2..7
    assert element_span(region, (4, 5), box) == (2, 7)
    assert region_blocks(Box.of((0, 0), (0, 3)), (4, 5)) == []


def test_exact_cover():
    shape = (4, 6)
    rows = [Box.of((0, 0), (2, 6)), Box.of((2, 0), (2, 6))]
    assert check_exact_cover(rows, shape) is None
    cols = [Box.of((0, c), (4, 2)) for c in (0, 2, 4)]
    assert check_exact_cover(cols, shape) is None
    flat = [FlatRange(0, 7), FlatRange(7, 20), FlatRange(20, 24)]
    assert check_exact_cover(flat, shape) is None
    mixed = [Box.of((0, 0), (2, 6)), FlatRange(12, 24)]
    assert check_exact_cover(mixed, shape) is None
    assert "overlap" in check_exact_cover([Box.of((0, 0), (3, 6)), Box.of((2, 0), (2, 6))], shape)
    assert "overlap" in check_exact_cover([FlatRange(0, 13), Box.of((2, 0), (2, 6))], shape)
    assert "cover 12 of 24" in check_exact_cover(rows[:1], shape)
    assert "outside" in check_exact_cover([Box.of((3, 0), (2, 6))], shape)
    assert "outside" in check_exact_cover([FlatRange(0, 25)], shape)
    assert check_exact_cover([Box.of((), ())], ()) is None
    assert "overlap" in check_exact_cover([Box.of((), ()), FlatRange(0, 1)], ())
    assert check_exact_cover([], (0, 5)) is None


def test_exact_cover_many_pieces_is_fast():
    n = 4096
    boxes = [FlatRange(i * 10, (i + 1) * 10) for i in range(n)]
    assert check_exact_cover(boxes, (n, 10)) is None
    grid = [Box.of((r * 2, c * 2), (2, 2)) for r in range(64) for c in range(64)]
    assert check_exact_cover(grid, (128, 128)) is None
