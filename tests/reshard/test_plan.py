"""The planner: copies and fills, coalescing, errors, and save → reshard → load round trips in numpy."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import pytest
from reshard_sim import execute, fill, global_arrays, save

from reshard import (
    Box,
    Copy,
    Fill,
    FlatRange,
    Layout,
    LocalBuffer,
    Mesh,
    ModelDims,
    PlanError,
    RankCoord,
    Rule,
    Slot,
    SourcePiece,
    check_sources,
    gpt_layout,
    gpt_shapes,
    llama_layout,
    llama_shapes,
    plan,
    plan_layout,
    state_shapes,
)

STATES = ("exp_avg",)


def buffers(layout: Layout, shapes: dict, coord: RankCoord) -> list[LocalBuffer]:
    """What a rank saves and loads: its weights and one optimizer state shaped like them."""
    return _all_buffers(layout, tuple(shapes.items()))[coord]


@lru_cache(maxsize=64)
def _all_buffers(layout: Layout, shapes: tuple) -> dict[RankCoord, list[LocalBuffer]]:
    out = {}
    for view in layout.resolve_all(dict(shapes)):
        bufs = view.weights()
        for key in STATES:
            bufs += view.optimizer_state(key)
        out[view.coord] = bufs
    return out


def all_shapes(shapes: dict) -> dict:
    out = dict(shapes)
    for key in STATES:
        out |= state_shapes(shapes, key)
    return out


def load(layout: Layout, shapes: dict, files: dict, sources: dict) -> dict[RankCoord, dict]:
    """Plan and execute the load of every rank of ``layout``; returns its buffers' arrays."""
    out = {}
    checked = check_sources(sources, all_shapes(shapes))
    for coord in layout.mesh.coords():
        bufs = buffers(layout, shapes, coord)
        out[coord] = execute(plan(bufs, checked, all_shapes(shapes)), files)
    return out


def save_layout(layout: Layout, shapes: dict, arrays: dict) -> tuple[dict, dict]:
    """Every rank of ``layout`` saves its buffers (filled from the global ``arrays``)."""
    ranks = []
    for coord in layout.mesh.coords():
        bufs = buffers(layout, shapes, coord)
        ranks.append((f"rank{layout.mesh.rank(coord)}", bufs, {b.name: fill(b, arrays) for b in bufs}))
    return save(ranks)


def check_loaded(layout: Layout, shapes: dict, loaded: dict, arrays: dict, what: str = "") -> None:
    for coord, got in loaded.items():
        for b in buffers(layout, shapes, coord):
            assert (got[b.name] == fill(b, arrays)).all(), f"{what} {coord} {b.name}"


def round_trip(src: Layout, dst: Layout, shapes: dict) -> None:
    """Save with ``src``, load into ``dst``, save that, load back into ``src``: everything exact."""
    arrays = global_arrays(all_shapes(shapes))
    files, sources = save_layout(src, shapes, arrays)
    loaded = load(dst, shapes, files, sources)
    check_loaded(dst, shapes, loaded, arrays, "there")
    ranks = [(f"dst{dst.mesh.rank(c)}", buffers(dst, shapes, c), got) for c, got in loaded.items()]
    files2, sources2 = save(ranks)  # saved from what was loaded, not from the global arrays
    check_loaded(src, shapes, load(src, shapes, files2, sources2), arrays, "back")


# -- unit behaviour ----------------------------------------------------------------------------------


def piece(file: str, offset: int, region: Box | FlatRange) -> SourcePiece:
    return SourcePiece(file, offset, region, 4)


def test_sub_box_of_a_stored_box_is_row_runs() -> None:
    stored = {"w": [piece("f", 100, Box((0, 0), (4, 6)))]}
    target = LocalBuffer("w", (4, 3), (Slot("w", Box((0, 0), (4, 3)), Box((0, 3), (4, 3))),))
    p = plan([target], stored, {"w": (4, 6)})
    assert p.copies == [Copy("f", 100 + 4 * (6 * r + 3), 12, "w", 3 * r, 3) for r in range(4)]
    assert p.fills == [] and p.nbytes == 48
    assert p.read_ranges() == {"f": [(112, 124), (136, 148), (160, 172), (184, 196)]}
    assert p.read_ranges(gap=12) == {"f": [(112, 196)]}


def test_whole_rows_coalesce_into_one_copy() -> None:
    stored = {"w": [piece("f", 0, Box((0, 0), (2, 6))), piece("f", 48, Box((2, 0), (2, 6)))]}
    target = LocalBuffer("w", (3, 6), (Slot("w", Box((0, 0), (3, 6)), Box((1, 0), (3, 6))),))
    assert plan([target], stored, {"w": (4, 6)}).copies == [Copy("f", 24, 72, "w", 0, 18)]


def test_fused_shard_reloads_as_one_copy_and_padding_as_a_fill() -> None:
    layout = Layout(
        mesh=Mesh(tp=2),
        rules=(Rule(name="qkv", dims="(tp [q:8 k:4 v:4]) h"), Rule(name="emb", dims="(tp v | pad=4) h")),
    )
    shapes = {"qkv": (16, 3), "emb": (5, 3)}
    arrays = global_arrays(shapes)
    ranks: list[tuple[str, Any, dict[str, Any]]]
    ranks = [(f"r{c.tp}", layout.resolve(shapes, c).weights(), {}) for c in layout.mesh.coords()]
    ranks = [(f, bufs, {b.name: fill(b, arrays) for b in bufs}) for f, bufs, _ in ranks]
    files, sources = save(ranks)
    p = plan(layout.resolve(shapes, RankCoord(tp=1)).weights(), sources, shapes)
    # q, k, v rows were saved one after the other and land one after the other: a single copy
    assert [c for c in p.copies if c.target == "qkv"] == [Copy("r1", 0, 8 * 3 * 4, "qkv", 0, 24)]
    # rank 1 of the vocabulary holds global row 4 and three padding rows (P = 8, local 4)
    assert p.fills == [Fill("emb", 3, 9)]
    got = execute(p, files)
    assert (got["emb"][0] == arrays["emb"][4]).all() and (got["emb"][1:] == 0).all()


def test_replicas_are_read_once_and_partial_overlaps_refused() -> None:
    target = LocalBuffer("w", (4,), (Slot("w", Box((0,), (4,)), Box((0,), (4,))),))
    dup = {"w": [piece("a", 0, Box((0,), (4,))), piece("b", 0, Box((0,), (4,)))]}
    assert plan([target], dup, {"w": (4,)}).copies == [Copy("a", 0, 16, "w", 0, 4)]
    bad = {"w": [piece("a", 0, Box((0,), (3,))), piece("b", 0, FlatRange(2, 4))]}
    with pytest.raises(
        PlanError, match=r"tensor 'w' \[4\]: the source pieces do not tile it exactly once: pieces 0 and 1 overlap"
    ):
        plan([target], bad, {"w": (4,)})
    gap = {"w": [piece("a", 0, Box((0,), (3,)))]}
    with pytest.raises(PlanError, match="pieces cover 3 of 4 elements"):
        plan([target], gap, {"w": (4,)})
    with pytest.raises(PlanError, match="wants tensor 'w', which the sources lack"):
        plan([target], {}, {"w": (4,)})


def test_bad_targets_are_refused() -> None:
    src = {"w": [piece("a", 0, Box((0,), (4,)))]}
    overlapping = LocalBuffer(
        "w", (4,), (Slot("w", FlatRange(0, 3), FlatRange(0, 3)), Slot("w", FlatRange(2, 3), FlatRange(3, 4)))
    )
    with pytest.raises(PlanError, match="elements from 2 are written twice"):
        plan([overlapping], src, {"w": (4,)})
    mismatch = LocalBuffer("w", (2, 2), (Slot("w", Box((0, 0), (2, 2)), FlatRange(0, 4)),))
    with pytest.raises(PlanError, match="a local box must map to a global box"):
        plan([mismatch], src, {"w": (4,)})
    outside = LocalBuffer("w", (2,), (Slot("w", FlatRange(0, 4), FlatRange(0, 4)),))
    with pytest.raises(PlanError, match="local range lies outside the buffer's 2 elements"):
        plan([outside], src, {"w": (4,)})


def test_dtype_width_is_respected_in_byte_offsets() -> None:
    stored = {"w": [SourcePiece("f", 8, FlatRange(0, 6), 2)]}
    target = LocalBuffer("w", (2, 3), (Slot("w", Box((0, 1), (2, 2)), Box((0, 1), (2, 2))),))
    p = plan([target], stored, {"w": (2, 3)})
    assert p.copies == [Copy("f", 10, 4, "w", 1, 2), Copy("f", 16, 4, "w", 4, 2)]
    assert p.fills == [Fill("w", 0, 1), Fill("w", 3, 1)]


# -- round trips -------------------------------------------------------------------------------------

TINY = ModelDims(hidden=16, layers=2, heads=8, kv_heads=4, head_dim=2, ffn=32, vocab=37, max_positions=8)
MATRIX = [(tp, pp, dp, z) for tp in (1, 2, 4) for pp in (1, 2) for dp in (1, 2, 4) for z in (0, 1, 3)]


def gpt(tp: int, pp: int, dp: int, stage: int, align: int = 2) -> Layout:
    return gpt_layout(
        TINY, Mesh(tp=tp, pp=pp, dp=dp), zero_stage=stage, zero_alignment=align, pad_vocab_to=4, sequence_parallel=True
    )


@pytest.mark.parametrize("tp, pp, dp, stage", MATRIX)
def test_gpt_round_trips(tp: int, pp: int, dp: int, stage: int) -> None:
    """Every TP × PP × DP × ZeRO layout to one rank and back, and to a shuffled partner and back."""
    shapes = gpt_shapes(TINY)
    round_trip(gpt(tp, pp, dp, stage), gpt(1, 1, 1, 0, 1), shapes)
    i = MATRIX.index((tp, pp, dp, stage))
    round_trip(gpt(tp, pp, dp, stage), gpt(*MATRIX[(i * 7 + 11) % len(MATRIX)], align=3), shapes)


@pytest.mark.full_matrix
@pytest.mark.parametrize("src", MATRIX)
def test_gpt_loads_full_cross_product(src: tuple) -> None:
    """Each layout's checkpoint loads exactly into every layout (so every round trip is the identity)."""
    shapes = gpt_shapes(TINY)
    arrays = global_arrays(all_shapes(shapes))
    files, sources = save_layout(gpt(*src), shapes, arrays)
    for dst in MATRIX:
        check_loaded(gpt(*dst), shapes, load(gpt(*dst), shapes, files, sources), arrays, f"{src} -> {dst}")


@pytest.mark.parametrize("fused", [False, True])
def test_llama_moe_round_trips(fused: bool) -> None:
    dims = ModelDims(hidden=8, layers=2, heads=4, kv_heads=2, head_dim=2, ffn=6, vocab=20, experts=4)
    shapes = llama_shapes(dims, fused_qkv=fused)
    a = llama_layout(dims, Mesh(tp=2, pp=2, dp=4, ep=2), zero_stage=1, fused_qkv=fused, pad_vocab_to=4)
    b = llama_layout(dims, Mesh(tp=1, pp=1, dp=4, ep=4), zero_stage=3, fused_qkv=fused, pad_vocab_to=4)
    c = llama_layout(dims, Mesh(tp=2, pp=1, dp=2, ep=1), zero_stage=0, fused_qkv=fused, pad_vocab_to=4)
    round_trip(a, b, shapes)
    round_trip(b, c, shapes)


def test_plan_layout_plans_every_rank() -> None:
    shapes = gpt_shapes(TINY)
    src, dst = gpt(2, 2, 2, 1), gpt(4, 1, 2, 3)
    arrays = global_arrays(all_shapes(shapes))
    files, sources = save_layout(src, shapes, arrays)
    plans = plan_layout(dst, shapes, sources, states=STATES)
    assert sorted(plans) == list(range(dst.mesh.world_size))
    loaded = {dst.mesh.coord(r): execute(p, files) for r, p in plans.items()}
    check_loaded(dst, shapes, loaded, arrays)


def test_reloading_into_the_same_layout_reads_each_saved_buffer_in_one_copy() -> None:
    shapes = gpt_shapes(TINY)
    layout = gpt(2, 1, 2, 1)
    arrays = global_arrays(all_shapes(shapes))
    files, sources = save_layout(layout, shapes, arrays)
    plans = plan_layout(layout, shapes, sources, states=STATES)
    for rank, p in plans.items():
        coord = layout.mesh.coord(rank)
        for b in buffers(layout, shapes, coord):
            if b.slots and all(s.replica == 0 for s in b.slots):  # saved whole by this rank
                assert [(c.file, c.count) for c in p.copies if c.target == b.name] == [
                    (f"rank{rank}", sum(s.local.numel for s in b.slots))
                ], b.name
