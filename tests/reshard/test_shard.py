"""Each split rule against an independent numpy oracle: the local array rank t must hold."""

from __future__ import annotations

import numpy as np
import pytest
from reshard_sim import fill, global_arrays

from reshard import Box, Layout, Mesh, PatternError, RankCoord, Rule, parse_pattern
from reshard.shard import shard


def local_of(
    pattern: str, shape: tuple[int, ...], tp: int = 1, t: int = 0, ep: int = 1, e: int = 0, dp: int = 1, d: int = 0
) -> np.ndarray:
    """The local array of one rank, built through the library's slots (compared to oracles below)."""
    layout = Layout(mesh=Mesh(tp=tp, dp=dp * ep, ep=ep), rules=(Rule(name="x", dims=pattern),))
    view = layout.resolve({"x": shape}, RankCoord(tp=t, dp=d * ep + e))
    return fill(view.tensors["x"], global_arrays({"x": shape}))


def g(shape: tuple[int, ...]) -> np.ndarray:
    return global_arrays({"x": shape})["x"]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_row_replicated(tp: int) -> None:
    x = g((8, 12))
    for t in range(tp):
        np.testing.assert_array_equal(local_of("(tp r) c", x.shape, tp, t), np.split(x, tp, axis=0)[t])
        np.testing.assert_array_equal(local_of("r (tp c)", x.shape, tp, t), np.split(x, tp, axis=1)[t])
        np.testing.assert_array_equal(local_of("r c", x.shape, tp, t), x)
        np.testing.assert_array_equal(local_of("...", x.shape, tp, t), x)


def test_fused_qkv_with_gqa() -> None:
    heads, kv, hd, h, tp = 8, 2, 3, 5, 2
    x = g(((heads + 2 * kv) * hd, h))
    q, k, v = np.split(x, [heads * hd, (heads + kv) * hd])
    pat = f"(tp [q:{heads}*{hd} k:{kv}*{hd} v:{kv}*{hd}] | unit={hd}) h"
    for t in range(tp):
        want = np.concatenate([np.split(q, tp)[t], np.split(k, tp)[t], np.split(v, tp)[t]])
        np.testing.assert_array_equal(local_of(pat, x.shape, tp, t), want)
    # one part's size left out takes the rest; none given means equal parts
    np.testing.assert_array_equal(
        local_of(f"(tp [q k:{kv * hd} v:{kv * hd}]) h", x.shape, tp, 1), local_of(pat, x.shape, tp, 1)
    )
    y = g((12, 2))
    a, b = np.split(y, 2)
    np.testing.assert_array_equal(local_of("(tp [gate up]) h", y.shape, 3, 2), np.concatenate([a[4:], b[4:]]))


def test_fused_qkv_shard_is_three_boxes() -> None:
    local_shape, pairs = shard(parse_pattern("(tp [q:8 k:4 v:4]) h"), (16, 3), {"tp": 2}, {"tp": 1})
    assert local_shape == (8, 3)
    assert pairs == [
        (Box((0, 0), (4, 3)), Box((4, 0), (4, 3))),
        (Box((4, 0), (2, 3)), Box((10, 0), (2, 3))),
        (Box((6, 0), (2, 3)), Box((14, 0), (2, 3))),
    ]


def test_padded_vocab() -> None:
    vocab, h, pad, tp = 37, 3, 4, 4
    x = g((vocab, h))
    padded = np.concatenate([x, np.zeros((48 - vocab, h), x.dtype)])  # ceil(37 / 16) * 16 = 48
    for t in range(tp):
        np.testing.assert_array_equal(local_of(f"(tp v | pad={pad}) h", x.shape, tp, t), padded[t * 12 : (t + 1) * 12])
    # the last rank holds one real row and 11 padding rows that map to nothing
    _, pairs = shard(parse_pattern("(tp v | pad=4) h"), (37, 3), {"tp": 4}, {"tp": 3})
    assert pairs == [(Box((0, 0), (1, 3)), Box((36, 0), (1, 3)))]
    _, pairs = shard(parse_pattern("(tp v | pad=4) h"), (33, 3), {"tp": 4}, {"tp": 3})
    assert pairs == []  # a shard of padding only


def test_uneven_rules() -> None:
    x = g((10, 2))
    first = np.array_split(x, 4)
    for t in range(4):
        np.testing.assert_array_equal(local_of("(tp r | uneven) c", x.shape, 4, t), first[t])
    chunks = [x[0:3], x[3:6], x[6:9], x[9:10]]  # torch.chunk(10, 4) sizes 3, 3, 3, 1
    for t in range(4):
        np.testing.assert_array_equal(local_of("(tp r | uneven=ceil) c", x.shape, 4, t), chunks[t])
    y = g((5, 2))  # chunk(5, 4): 2, 2, 1, and an empty last shard
    assert local_of("(tp r | uneven=ceil) c", y.shape, 4, 3).shape == (0, 2)
    with pytest.raises(PatternError, match="dim 0 has size 10, not divisible by tp=4"):
        local_of("(tp r) c", x.shape, 4, 0)


def test_expert_stack_and_multi_axis() -> None:
    x = g((4, 6, 2))  # 4 experts of [6, 2]
    for e in range(2):
        for t in range(3):
            want = np.split(np.split(x, 2, axis=0)[e], 3, axis=1)[t]
            np.testing.assert_array_equal(local_of("(ep e) (tp f) h", x.shape, tp=3, t=t, ep=2, e=e), want)
    y = g((12, 2))
    for e in range(2):
        for t in range(3):
            np.testing.assert_array_equal(
                local_of("(ep tp r) c", y.shape, tp=3, t=t, ep=2, e=e), np.split(y, 6)[e * 3 + t]
            )
    with pytest.raises(PatternError, match="dim 0 has size 4, not divisible by ep=3"):
        local_of("(ep e) ...", x.shape, ep=3)


def test_dp_split_is_fsdp_style() -> None:
    x = g((8, 2))
    np.testing.assert_array_equal(local_of("(dp r) c", x.shape, dp=4, d=2), x[4:6])


def test_size_assertion_and_rank_mismatch() -> None:
    with pytest.raises(PatternError, match=r"dim 1 is declared h:5 but the tensor's size is 4"):
        local_of("r h:5", (2, 4))
    with pytest.raises(PatternError, match=r"the pattern has 2 dims but the tensor has shape \[2, 4, 3\]"):
        local_of("(tp r) c", (2, 4, 3))
    with pytest.raises(PatternError, match=r"has size 10, which the parts \[q:4 k:4\] do not add up to"):
        local_of("(tp [q:4 k:4]) c", (10, 2))


def test_scalar_and_empty_tensors() -> None:
    assert local_of("", ()).shape == () and int(local_of("", ())) == 1
    assert local_of("...", ()).shape == ()
    assert local_of("(tp r) c", (0, 3), 2, 1).shape == (0, 3)
