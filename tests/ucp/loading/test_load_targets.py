"""Edge cases of ``ucp.load(into=...)`` and the reshard layout math: casts, odd targets (tuples,
parameters, meta, expanded and conjugate views), validation of slots and patterns."""

from __future__ import annotations

import threading

import pytest
import torch
from ucp_helpers import random_tensor, same_bytes, save_ranks

import ucp
from reshard import Box, FlatRange, Layout, Mesh, PatternError, PlanError, Rule, SourcePiece, parse_pattern, plan
from reshard.errors import LayoutError
from reshard.resolve import LocalBuffer, Slot

W = random_tensor(torch.float32, (8, 6), seed=11)  # 2 row shards
F = random_tensor(torch.float32, (5, 7), seed=12)  # 2 uneven flat shards
S = random_tensor(torch.bfloat16, (), seed=13)  # 0-d, replicated
E = torch.zeros(0, 3)  # empty, replicated


def _rank(r: int) -> dict:
    cut = [0, 17, 35]
    return {
        "w": ucp.ShardedTensor(W[4 * r : 4 * r + 4], (8, 6), (4 * r, 0)),
        "f": ucp.FlatShard(F.reshape(-1)[cut[r] : cut[r + 1]], (5, 7), cut[r]),
        "s": ucp.ShardedTensor(S.clone(), (), (), replica_id=r),
        "e": ucp.ShardedTensor(E.clone(), (0, 3), (0, 0), replica_id=r),
        "opt": {0: {"lr": 0.1}, "betas": (0.9, 0.999), "pair": (torch.arange(3) + 10 * r, 7)},
    }


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    path = tmp_path_factory.mktemp("edges") / "ck"
    save_ranks(path, [_rank(0), _rank(1)])
    return path


# -- behaviour that holds (probed, fine) ------------------------------------------------------------


@pytest.mark.parametrize("verify", [True, False])
def test_bf16_from_fp32_rounds_like_torch_to(ck, verify):
    full = torch.zeros(8, 6, dtype=torch.bfloat16)
    part = ucp.ShardedTensor(torch.zeros(5, 3, dtype=torch.bfloat16), (8, 6), (2, 1))  # spans both pieces
    flat = ucp.FlatShard(torch.zeros(20, dtype=torch.float16), (5, 7), 9)
    ucp.load(ck, into={"w": full, "f": flat}, verify=verify)
    ucp.load(ck, into={"w": part}, verify=verify)
    assert same_bytes(full, W.to(torch.bfloat16))
    assert same_bytes(part.local, W[2:7, 1:4].to(torch.bfloat16))
    assert same_bytes(flat.local, F.reshape(-1)[9:29].to(torch.float16))


def test_zero_d_and_empty_targets(ck):
    s, s32, e = torch.zeros((), dtype=torch.bfloat16), torch.zeros(()), torch.ones(0, 3)
    ucp.load(ck, into={"s": s, "e": e})
    assert same_bytes(s, S) and e.shape == (0, 3)
    ucp.load(ck, into={"s": ucp.FlatShard(s32.reshape(1), (), 0)})
    assert same_bytes(s32, S.float())
    out = ucp.load(ck)
    assert same_bytes(out["s"], S) and same_bytes(out["e"], E)


@pytest.mark.parametrize("verify", [True, False])
def test_shards_with_zero_length_parts(ck, verify):
    loc = torch.zeros(8, 6)
    flat = torch.zeros(35)
    into = {
        "w": ucp.Shards([ucp.ShardedTensor(loc[:0], (8, 6), (8, 0)), ucp.ShardedTensor(loc, (8, 6), (0, 0))]),
        "f": ucp.Shards([ucp.FlatShard(flat[:0], (5, 7), 35), ucp.FlatShard(flat, (5, 7), 0)]),
    }
    ucp.load(ck, into=into, verify=verify)
    assert same_bytes(loc, W) and same_bytes(flat, F.reshape(-1))


@pytest.mark.parametrize("verify", [True, False])
def test_one_piece_feeds_several_targets(ck, verify):
    """Overlapping parts of one Shards, each fed from the same stored pieces (a partial span when not verifying)."""
    loc = torch.zeros(10, 6, dtype=torch.float64)
    flat = torch.zeros(30)
    into = {
        "w": ucp.Shards([ucp.ShardedTensor(loc[:3], (8, 6), (1, 0)), ucp.ShardedTensor(loc[3:], (8, 6), (1, 0))]),
        "f": ucp.Shards([ucp.FlatShard(flat[:10], (5, 7), 3), ucp.FlatShard(flat[10:], (5, 7), 14)]),
    }
    ucp.load(ck, into=into, verify=verify)
    assert same_bytes(loc[:3], W[1:4].double()) and same_bytes(loc[3:], W[1:8].double())
    assert same_bytes(flat[:10], F.reshape(-1)[3:13]) and same_bytes(flat[10:], F.reshape(-1)[14:34])


def test_flat_target_of_box_pieces_and_box_target_of_flat_pieces(ck):
    fl, bx = torch.zeros(20), torch.zeros(5, 3).t()  # the box target non-contiguous
    ucp.load(ck, into={"w": ucp.FlatShard(fl, (8, 6), 13), "f": ucp.ShardedTensor(bx, (5, 7), (1, 2))}, verify=False)
    assert same_bytes(fl, W.reshape(-1)[13:33]) and same_bytes(bx.contiguous(), F[1:4, 2:7].contiguous())


def test_partial_into_ignores_other_keys_and_keeps_int_keys(ck):
    into = {"opt": {0: {"lr": None}}}
    assert ucp.load(ck, into=into, strict=False).state is into  # strict=False: the rest of 'opt' is left unread
    assert into == {"opt": {0: {"lr": 0.1}}}
    with pytest.raises(ucp.LayoutMismatchError, match=r"missing from the checkpoint .*: state_dict\['opt'\]\['0'\]"):
        ucp.load(ck, into={"opt": {"0": {"lr": None}}})


def test_tied_targets_same_memory(tmp_path):
    """Tied weights (one tensor under two keys) load the data both names hold."""
    t = random_tensor(torch.float32, (4, 4), seed=3)
    ucp.save({"emb": t, "head": t}, tmp_path / "ck")
    tied = torch.zeros(4, 4)
    ucp.load(tmp_path / "ck", into={"emb": tied, "head": tied})
    assert same_bytes(tied, t)


def test_concurrent_loads_from_threads(ck):
    results: list[object] = []

    def worker(i: int) -> None:
        try:
            for _ in range(3):
                t, f = torch.zeros(8, 6), ucp.FlatShard(torch.zeros(20), (5, 7), 7)
                ucp.load(ck, into={"w": t, "f": f}, verify=bool(i % 2))
                out = ucp.load(ck)
                results.append(
                    same_bytes(t, W) and same_bytes(f.local, F.reshape(-1)[7:27]) and same_bytes(out["w"], W)
                )
        except Exception as exc:  # reported below
            results.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert results == [True] * 12


@pytest.mark.parametrize(
    "text, where",
    [
        ("(tp r", "')' closing the group"),
        ("(tp r))", "expected a dimension, found ')'"),
        ("((tp r)", "at least one mesh axis"),
        ("(tp [q k v)", "a part name or ']'"),
        ("(tp r | unit=2*)", "a number after '*'"),
    ],
)
def test_pattern_syntax_errors_show_the_pattern(text, where):
    with pytest.raises(PatternError, match=__import__("re").escape(where)) as info:
        parse_pattern(text)
    assert text in str(info.value) and "^" in str(info.value)


def _layout(dims: str, tp: int, name: str = "w") -> Layout:
    return Layout(mesh=Mesh(tp=tp), rules=[Rule(name=name, dims=dims)])


@pytest.mark.parametrize(
    "dims, shape, tp, match",
    [
        ("(tp r) c", (10, 3), 4, r"tensor 'w' \[10, 3\].*dim 0 has size 10, not divisible by tp=4"),
        (
            "(tp [q:32*8 k:3*8 v:3*8] | unit=8) h",
            (304, 4),
            2,
            r"tensor 'w'.*part 'k' has 3 units of 8, not divisible by tp=2",
        ),
        ("(tp [q:32 k:8 v:8] | unit=8) h", (50, 4), 2, r"tensor 'w'.*parts \[q:32 k:8 v:8\] do not add up"),
        ("(tp r | unit=4) c", (10, 3), 2, r"tensor 'w'.*not a multiple of unit=4"),
    ],
)
def test_pattern_misfit_errors_name_the_tensor(dims, shape, tp, match):
    with pytest.raises(PatternError, match=match):
        _layout(dims, tp).resolve({"w": shape}, 0)


def test_pad_larger_than_a_shard_leaves_ranks_with_padding_only():
    lay = _layout("(tp v | pad=128) h", 4)
    lay.check({"w": (10, 2)})
    views = [lay.resolve({"w": (10, 2)}, r).tensors["w"] for r in range(4)]
    assert [v.shape for v in views] == [(128, 2)] * 4
    assert views[0].slots[0].glob == Box((0, 0), (10, 2)) and all(not v.slots for v in views[1:])


def test_two_rules_matching_one_tensor_names_both():
    lay = Layout(mesh=Mesh(tp=2), rules=[Rule(name="w*", dims="(tp r) c"), Rule(name="*w", dims="r (tp c)")])
    with pytest.raises(LayoutError, match=r"tensor 'w' matches two rules: 0 'w\*'.*1 '\*w'"):
        lay.resolve({"w": (4, 4)}, 0)


# -- bugs ------------------------------------------------------------------------------------------


def test_plain_values_inside_tuples_are_loaded(ck):
    into = {"opt": {"betas": (0.5, 0.6), "pair": (torch.zeros(3, dtype=torch.int64), 0)}}
    ucp.load(ck, into=into, strict=False)
    assert same_bytes(into["opt"]["pair"][0], torch.arange(3))  # the tensor in the tuple is filled...
    assert into["opt"]["betas"] == (0.9, 0.999)  # ...but these stay (0.5, 0.6)
    assert into["opt"]["pair"][1] == 7


def test_optimizer_betas_restored_into_fresh_optimizer(tmp_path):
    model = torch.nn.Linear(2, 2)
    ucp.save({"optim": torch.optim.Adam(model.parameters(), betas=(0.8, 0.88)).state_dict()}, tmp_path / "ck")
    target = {"optim": torch.optim.Adam(model.parameters()).state_dict()}
    ucp.load(tmp_path / "ck", into=target)
    assert target["optim"]["param_groups"][0]["betas"] == (0.8, 0.88)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_requires_grad_target_is_filled(ck, dtype):
    p = torch.nn.Parameter(torch.zeros(8, 6, dtype=dtype))
    ucp.load(ck, into={"w": p})
    assert same_bytes(p.detach(), W.to(dtype)) and p.requires_grad


def test_meta_target_is_refused_naming_the_tensor(ck):
    with pytest.raises(ucp.CheckpointError, match=r"'w'.*meta|meta.*'w'"):
        ucp.load(ck, into={"w": torch.empty(8, 6, device="meta")})


def test_self_overlapping_target_error_names_the_tensor(ck):
    with pytest.raises(ucp.CheckpointError, match=r"'w'"):
        ucp.load(ck, into={"w": torch.zeros(6).expand(8, 6)})


def test_conjugate_view_target(tmp_path):
    c = torch.complex(random_tensor(torch.float32, (4,), seed=1), random_tensor(torch.float32, (4,), seed=2))
    ucp.save({"c": c}, tmp_path / "ck")
    target = torch.zeros(4, dtype=torch.complex64).conj()
    ucp.load(tmp_path / "ck", into={"c": target})
    assert same_bytes(target.resolve_conj(), c)


def test_plan_refuses_flat_slot_past_the_tensor():
    sources = {"w": [SourcePiece("a", 0, FlatRange(0, 12), 4)]}
    buf = LocalBuffer("b", (15,), (Slot("w", FlatRange(0, 15), FlatRange(0, 15)),))
    with pytest.raises(PlanError, match=r"'w'"):
        plan([buf], sources, {"w": (4, 3)})
