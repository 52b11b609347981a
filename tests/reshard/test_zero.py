"""ZeRO partitions of TP-local tensors, checked against numpy flattening, and their global regions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from reshard_sim import fill, global_arrays

from reshard import (
    Box,
    FlatRange,
    Layout,
    Mesh,
    ModelDims,
    RankCoord,
    Rule,
    Zero,
    gpt_layout,
    gpt_shapes,
    llama_layout,
    llama_shapes,
    local_flat_to_global,
    parse_pattern,
    partition_size,
)
from reshard.shard import shard
from reshard.zero import group_partition, param_partition

TINY = ModelDims(hidden=16, layers=2, heads=8, kv_heads=4, head_dim=2, ffn=32, vocab=37, max_positions=8)


def test_partition_arithmetic() -> None:
    assert partition_size(10, 4, 1) == 3 and partition_size(10, 4, 4) == 4 and partition_size(0, 4, 2) == 0
    size, entries = group_partition([5, 7, 3], 2, 1, 2)  # T = 15, P = roundup(8, 2) = 8: rank 1 holds [8, 16)
    assert size == 8 and entries == [(1, 3, 7), (2, 0, 3)]
    assert param_partition(10, 4, 3, 1) == (3, 9, 10)
    assert param_partition(2, 4, 3, 1) == (1, 2, 2)  # nothing left for the last ranks


def pairs_of(pattern: str, shape: tuple[int, ...], tp: int, t: int):
    return shard(parse_pattern(pattern), shape, {"tp": tp, "dp": 1, "ep": 1}, {"tp": t, "dp": 0, "ep": 0})


def test_column_parallel_range_is_one_shifted_flat_range() -> None:
    local_shape, pairs = pairs_of("(tp r) c", (8, 5), 2, 1)  # rank 1 holds global rows 4..7 = elements 20..39
    assert local_flat_to_global(local_shape, pairs, (8, 5), 3, 17) == [(0, FlatRange(23, 37))]


def test_row_parallel_range_is_at_most_three_boxes() -> None:
    local_shape, pairs = pairs_of("r (tp c)", (4, 6), 2, 1)  # local [4, 3] = global columns 3..5
    got = local_flat_to_global(local_shape, pairs, (4, 6), 1, 11)  # partial row 0, rows 1..2, partial row 3
    assert got == [(0, FlatRange(4, 6)), (2, Box((1, 3), (2, 3))), (8, FlatRange(21, 23))]
    # the local buffer holds the box in the box's row-major order: check element by element
    g = np.arange(24).reshape(4, 6)
    local = g[:, 3:].reshape(-1)[1:11]
    assert list(local[2:8]) == list(g[1:3, 3:6].reshape(-1))
    local_shape, pairs = pairs_of("a r (tp c)", (2, 3, 4), 2, 0)
    assert local_flat_to_global(local_shape, pairs, (2, 3, 4), 0, 12) == [(0, Box((0, 0, 0), (2, 3, 2)))]


def test_fused_and_padded_ranges() -> None:
    local_shape, pairs = pairs_of("(tp [q:8 k:4 v:4]) h", (16, 2), 2, 1)  # local rows: q 4..7, k 10..11, v 14..15
    assert local_flat_to_global(local_shape, pairs, (16, 2), 0, 16) == [
        (0, FlatRange(8, 16)),
        (8, FlatRange(20, 24)),
        (12, FlatRange(28, 32)),
    ]
    local_shape, pairs = pairs_of("(tp v | pad=4) h", (37, 2), 4, 3)  # 1 real row, 11 padding rows
    assert local_flat_to_global(local_shape, pairs, (37, 2), 0, 24) == [(0, FlatRange(72, 74))]
    assert local_flat_to_global(local_shape, pairs, (37, 2), 2, 24) == []


def test_local_pieces_cut_where_a_slot_ends_mid_row() -> None:
    # fused parts along dim 1: local rows are [a_t | b_t], so a local row is two global runs
    local_shape, pairs = pairs_of("r (tp [a:4 b:2])", (2, 6), 2, 1)  # local [2, 3]: a cols 2..3, b col 5
    got = local_flat_to_global(local_shape, pairs, (2, 6), 0, 6)
    assert got == [(0, FlatRange(2, 4)), (2, FlatRange(5, 6)), (3, FlatRange(8, 10)), (5, FlatRange(11, 12))]


def zero_oracle(layout: Layout, shapes: dict, coord: RankCoord) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Per group the rank's flat partition, and (stage 3) each param's, built with numpy from the local tensors."""
    view = layout.resolve(shapes, coord)
    arrays = global_arrays(shapes)
    local = {n: fill(t, arrays).reshape(-1) for n, t in view.tensors.items()}
    dp, ep = layout.mesh.dp, layout.mesh.ep
    align = layout.zero.alignment
    groups, params = [], {}
    for g in range(len(layout.zero.groups)):
        members = [n for n in view.tensors if layout.zero.group_of(n) == g]
        expert = any("experts" in n for n in members)
        parts, d = (dp // ep, coord.dp // ep) if expert else (dp, coord.dp)
        if layout.zero.stage == 3:
            chunks = []
            for n in members:
                p = math.ceil(math.ceil(local[n].size / parts) / align) * align
                padded = np.zeros(p * parts, np.int32)
                padded[: local[n].size] = local[n]
                params[n] = padded[d * p : (d + 1) * p]
                chunks.append(params[n])
            groups.append(np.concatenate(chunks) if chunks else np.zeros(0, np.int32))
        else:
            flat = np.concatenate([local[n] for n in members]) if members else np.zeros(0, np.int32)
            p = math.ceil(math.ceil(flat.size / parts) / align) * align
            padded = np.zeros(p * parts, np.int32)
            padded[: flat.size] = flat
            groups.append(padded[d * p : (d + 1) * p])
    return groups, params


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("tp, pp, dp, align", [(2, 1, 3, 1), (4, 2, 2, 4), (1, 2, 4, 2), (2, 2, 4, 8)])
def test_gpt_partitions_match_numpy(stage: int, tp: int, pp: int, dp: int, align: int) -> None:
    shapes = gpt_shapes(TINY)
    layout = gpt_layout(TINY, Mesh(tp=tp, pp=pp, dp=dp), zero_stage=stage, zero_alignment=align, pad_vocab_to=4)
    arrays = global_arrays(shapes)
    for coord in layout.mesh.coords():
        view = layout.resolve(shapes, coord)
        groups, params = zero_oracle(layout, shapes, coord)
        assert len(view.zero_groups) == len(groups) == 2
        for buf, want in zip(view.zero_groups, groups):
            np.testing.assert_array_equal(fill(buf, arrays), want, err_msg=f"{coord} {buf.name}")
        if stage == 3:
            assert set(view.zero_params) == set(params)
            for n, want in params.items():
                np.testing.assert_array_equal(fill(view.zero_params[n], arrays), want, err_msg=f"{coord} {n}")


def test_expert_groups_partition_over_expert_data_parallel_ranks() -> None:
    dims = ModelDims(hidden=8, layers=1, heads=2, vocab=16, ffn=12, experts=4)
    shapes = llama_shapes(dims)
    layout = llama_layout(dims, Mesh(tp=2, dp=4, ep=2), zero_stage=1)
    arrays = global_arrays(shapes)
    for coord in layout.mesh.coords():
        view = layout.resolve(shapes, coord)
        groups, _ = zero_oracle(layout, shapes, coord)
        for buf, want in zip(view.zero_groups, groups):
            np.testing.assert_array_equal(fill(buf, arrays), want, err_msg=f"{coord} {buf.name}")
    # the expert group of dp rank 1 (ep 1, edp 0) and dp rank 3 (ep 1, edp 1) split ep shard 1 between them
    a = layout.resolve(shapes, RankCoord(dp=1)).zero_groups[0]
    b = layout.resolve(shapes, RankCoord(dp=3)).zero_groups[0]
    total = sum(math.prod(layout.resolve(shapes, RankCoord(dp=1)).tensors[n].shape) for n in shapes if "experts" in n)
    assert a.numel == b.numel == total // 2


def test_frozen_params_and_dp_split_params() -> None:
    shapes = {"w": (4, 4), "frozen": (4,), "fsdp": (8, 2)}
    layout = Layout(
        mesh=Mesh(dp=2),
        zero=Zero(stage=3, groups=(("w", "fsdp"),)),
        rules=(Rule(name="w", dims="(tp r) c"), Rule(name="frozen", dims="r"), Rule(name="fsdp", dims="(dp r) c")),
    )
    view = layout.resolve(shapes, RankCoord(dp=1))
    assert set(view.zero_params) == {"w", "frozen"}  # stage 3 partitions every param ZeRO flattens, frozen too
    assert [s.tensor for s in view.zero_groups[0].slots] == ["w"]  # the dp-split tensor is left to its pattern
    states = {b.name: b for b in view.optimizer_state("exp_avg")}
    assert set(states) == {"zero.0.exp_avg", "fsdp.exp_avg"}  # frozen params have no optimizer state
    assert states["fsdp.exp_avg"].slots[0].glob == Box((4, 0), (4, 2))
    assert [b.name for b in view.weights()] == ["w", "frozen", "fsdp"] and view.weights()[2].shape == (4, 2)
    layout.check(shapes)
