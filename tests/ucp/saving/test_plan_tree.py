"""Planning (who writes what, file layout) and the state tree (names, merge) — pure functions."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import ucp
from ucp.format.tree import check_tree, decode_state, encode_state, merge_trees
from ucp.saving.plan import DATA_ALIGNMENT, PlanCache, assign_replicated, leaf_layout, make_plan


def layouts(state):
    return [leaf_layout(leaf) for leaf in encode_state(state).leaves]


def test_names_are_key_paths_and_unique():
    enc = encode_state(
        {
            "a": {"b": torch.ones(1)},
            "a.b": torch.ones(1),
            "l": [torch.ones(1)],
            3: {0: torch.ones(1)},
            "__metadata__": torch.ones(1),
        }
    )
    names = [leaf.name for leaf in enc.leaves]
    assert names == ["a.b", "a.b~1", "l.0", "3.0", "__metadata__~1"]


def test_tree_round_trip_and_check():
    state = {"d": {1: "x", "y": (1, [2.5, None])}, "f": float("inf"), "t": torch.ones(2), "e": {}}
    enc = encode_state(state)
    json.dumps(enc.tree, allow_nan=False)  # plain JSON
    assert check_tree(enc.tree) == ["t"]
    out = decode_state(enc.tree, lambda n: "T:" + n)
    assert out == {"d": {1: "x", "y": (1, [2.5, None])}, "f": float("inf"), "t": "T:t", "e": {}}


def test_merge_trees_unions_rank_specific_keys():
    a = encode_state({"common": 1, "r0": {"x": 1}, "m": {0: "a"}}).tree
    b = encode_state({"common": 2, "r1": {"y": 2}, "m": {1: "b"}}).tree
    merged = decode_state(merge_trees([a, b]), lambda n: n)
    assert merged == {"common": 1, "r0": {"x": 1}, "m": {0: "a", 1: "b"}, "r1": {"y": 2}}


def test_replicated_tensors_spread_deterministically():
    lay = layouts({f"t{i}": torch.zeros(100 * (i + 1)) for i in range(6)})
    owners = assign_replicated(lay, 3)
    assert owners == assign_replicated(list(reversed(lay)), 3)  # order of discovery does not matter
    loads = [sum(x.nbytes for x in lay if owners[x.name] == r) for r in range(3)]
    assert max(loads) - min(loads) <= 600 * 4
    plans = [make_plan(lay, r, 3) for r in range(3)]
    written = sorted(p.name for plan in plans for p in plan.pieces)
    assert written == sorted(x.name for x in lay)  # each once


def test_file_layout():
    state = {
        "a": torch.zeros(3, dtype=torch.int8),
        "b": torch.zeros(5, dtype=torch.float64),
        "c": ucp.FlatShard(torch.zeros(7, dtype=torch.bfloat16), (4, 4), 2),
        "d": torch.zeros(0),
    }
    plan = make_plan(layouts(state), 0, 1)
    assert plan.data_start % DATA_ALIGNMENT == 0 and len(plan.header) == plan.data_start
    (n,) = struct.unpack("<Q", plan.header[:8])
    header = json.loads(plan.header[8 : 8 + n])
    assert plan.header[8 + len(json.dumps(header, separators=(",", ":"))) :].strip(b" ") == b""
    assert [p.name for p in plan.pieces] == ["b", "d", "c", "a"]  # by itemsize desc, then name
    assert header["c"] == {"dtype": "BF16", "shape": [7], "data_offsets": [40, 54]}
    assert plan.file_size == plan.data_start + 40 + 14 + 3
    for p in plan.pieces:
        assert (
            p.offset
            % torch.empty(
                0, dtype={"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "I8": torch.int8}[p.dtype]
            ).itemsize
            == 0
        )


def test_non_writing_rank_has_no_file():
    lay = layouts({"s": ucp.ShardedTensor(torch.zeros(2), (2,), (0,), replica_id=1)})
    plan = make_plan(lay, 1, 2)
    assert plan.file is None and plan.pieces == () and plan.tensors == (("s", "F32", (2,)),)


def test_plan_cache_lru():
    cache = PlanCache(capacity=2)
    a, b, c = (layouts({"x": torch.zeros(n)}) for n in (1, 2, 3))
    pa = cache.get_or_make(a, 0, 1)
    assert cache.get_or_make(a, 0, 1) is pa and cache.hits == 1
    cache.get_or_make(b, 0, 1)
    cache.get_or_make(c, 0, 1)  # evicts a
    assert cache.get_or_make(a, 0, 1) is not pa and cache.misses == 4


def test_sharded_tensor_validation():
    with pytest.raises(ValueError, match="outside"):
        ucp.ShardedTensor(torch.zeros(2, 2), (3, 3), (2, 0))
    with pytest.raises(ValueError, match="same rank"):
        ucp.ShardedTensor(torch.zeros(2, 2), (3,), (0,))
    with pytest.raises(ValueError, match="1-d"):
        ucp.FlatShard(torch.zeros(2, 2), (9,), 0)
    with pytest.raises(ValueError, match="outside"):
        ucp.FlatShard(torch.zeros(5), (2, 3), 2)
    with pytest.raises(ValueError, match="non-negative"):
        ucp.ShardedTensor(torch.zeros(1), (3,), (-1,))
