"""The tensor-grain budget plan on the benchmark's 2.26 GB Llama (no files: layouts only): the ring's size,
which tensors stay resident, the bytes streamed per pass against the bound ``weights - (budget - ring)``,
never over the budget, and the clear error below the smallest budget that streams."""

from __future__ import annotations

import pytest

from training.inference.errors import BudgetError
from training.inference.layout import GroupLayout, Placed
from training.inference.plan import RING_TARGET, Plan, plan_layers, plan_tensors, spread

MiB = 1 << 20
HIDDEN, KV, FF, VOCAB, LAYERS = 2048, 512, 5504, 8192, 12  # tools/bench_infer.py's model (fp32: 2.26 GB)


def one(name: str, shape: tuple[int, ...], size: int) -> GroupLayout:
    nbytes = size
    for d in shape:
        nbytes *= d
    dtype = "F32" if size == 4 else "BF16"
    return GroupLayout(name, [name], {"f": [(0, 0, nbytes)]}, [Placed(name, dtype, shape, 0, nbytes)], nbytes)


def llama(size: int) -> tuple[list[list[GroupLayout]], list[list[list[GroupLayout]]], list[list[GroupLayout]]]:
    """pre, layers, post of the benchmark model as stages of one-tensor layouts (every tensor a page multiple)."""

    def layer(i: int) -> list[list[GroupLayout]]:
        p = f"model.layers.{i}."
        t = {n: one(p + n, s, size) for n, s in LAYER_SHAPES.items()}
        cuts = [["input_layernorm.weight", "self_attn.q_proj.weight"], ["self_attn.k_proj.weight"]]
        cuts += [["self_attn.v_proj.weight"], ["self_attn.o_proj.weight", "post_attention_layernorm.weight"]]
        cuts += [["mlp.gate_proj.weight"], ["mlp.up_proj.weight"], ["mlp.down_proj.weight"]]
        return [[t[n] for n in stage] for stage in cuts]

    pre = [[one("model.embed_tokens.weight", (VOCAB, HIDDEN), size)]]
    post = [[one("model.norm.weight", (HIDDEN,), size), one("lm_head.weight", (VOCAB, HIDDEN), size)]]
    return pre, [layer(i) for i in range(LAYERS)], post


LAYER_SHAPES = {
    "input_layernorm.weight": (HIDDEN,),
    "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
    "self_attn.k_proj.weight": (KV, HIDDEN),
    "self_attn.v_proj.weight": (KV, HIDDEN),
    "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
    "post_attention_layernorm.weight": (HIDDEN,),
    "mlp.gate_proj.weight": (FF, HIDDEN),
    "mlp.up_proj.weight": (FF, HIDDEN),
    "mlp.down_proj.weight": (HIDDEN, FF),
}


def weights(size: int) -> tuple[int, int, int]:
    """(every weight's bytes, the edges' bytes, the largest layer tensor's bytes) at ``size`` bytes an element."""
    layer = size * (2 * HIDDEN + 2 * HIDDEN * HIDDEN + 2 * KV * HIDDEN + 3 * FF * HIDDEN)
    edges = size * (2 * VOCAB * HIDDEN + HIDDEN)
    return edges + LAYERS * layer, edges, size * FF * HIDDEN


def streamed_names(p: Plan) -> set[str]:
    return {t.name for u in p.units for t in u.tensors}


def check_plan(p: Plan, size: int, budget: int) -> None:
    """Never over the budget; every layer tensor resident or streamed once a pass; the bound holds and is
    met but for what no streamed tensor fits in."""
    total, edges, _ = weights(size)
    assert p.resident_bytes + p.ring_bytes <= budget
    assert p.ring_bytes >= 2 * p.slot_bytes  # room for one part computing while the next is read
    assert not set(p.pinned_tensors) & streamed_names(p)
    assert len(p.pinned_tensors) + len(streamed_names(p)) == LAYERS * len(LAYER_SHAPES)
    assert p.streamed_bytes_per_pass == total - p.resident_bytes  # edges resident, the rest once a pass
    bound = total - (budget - p.ring_bytes)  # fewest bytes a pass can stream with this ring
    left = budget - p.resident_bytes - p.ring_bytes
    assert p.streamed_bytes_per_pass == bound + left
    smallest = min(t.nbytes for u in p.units for t in u.tensors)
    assert left < smallest  # nothing more fits: the plan meets the bound to within one tensor


@pytest.mark.parametrize("size", [4, 2])
def test_512mib_pins_the_largest_tensors_beside_a_ring_of_the_disk_target(size: int) -> None:
    pre, layers, post = llama(size)
    total, edges, mlp = weights(size)
    budget = 512 * MiB
    p = plan_tensors(pre, layers, post, budget, edge_bytes=edges)
    assert p.grain == "tensor" and p.resident[:2] == ["embedding", "final norm and head"]
    assert p.ring_bytes == RING_TARGET == 128 * MiB and p.slot_bytes == mlp  # gate, up, down: the largest parts
    check_plan(p, size, budget)
    room = budget - edges - RING_TARGET
    n_mlp = room // mlp
    pinned_mlp = [n for n in p.pinned_tensors if ".mlp." in n]
    assert len(pinned_mlp) == n_mlp  # largest first ...
    # ... one of a kind per layer, the layers spread over the depth: gates first, then ups
    want = [
        f"model.layers.{spread(LAYERS)[k % LAYERS]}.mlp.{'gate' if k < LAYERS else 'up'}_proj.weight"
        for k in range(n_mlp)
    ]
    assert sorted(pinned_mlp) == sorted(want)
    # the whole-layer ring of the device paths: two layer buffers, what is left holds no whole layer
    joined = [join(g) for g in layers]
    whole = plan_layers(
        join(pre), joined, join(post), budget, resident_bytes=edges, layer_resident_bytes=[g.nbytes for g in joined]
    )
    assert p.streamed_bytes_per_pass < whole.streamed_bytes_per_pass
    if size == 4:  # fp32: 1.98 GiB -> 1.73 GiB a pass (12.7 % fewer)
        assert whole.streamed_bytes_per_pass == total - edges
        assert p.streamed_bytes_per_pass / whole.streamed_bytes_per_pass < 0.88


def join(stages: list[list[GroupLayout]]) -> GroupLayout:
    from training.inference.layout import join_layouts

    return join_layouts("g", [t for s in stages for t in s])


@pytest.mark.parametrize("budget_mib", [160, 200, 256, 384, 512, 768, 1024, 1536, 2048])
def test_never_over_the_budget_and_within_a_tensor_of_the_bound(budget_mib: int) -> None:
    pre, layers, post = llama(4)
    total, edges, mlp = weights(4)
    budget = budget_mib * MiB
    p = plan_tensors(pre, layers, post, budget, edge_bytes=edges)
    if budget < edges + 2 * mlp:  # the edges do not fit beside two of the largest part: everything streams
        assert p.resident == [] and p.resident_bytes == 0 and p.ring_bytes <= budget
        assert p.streamed_bytes_per_pass == total + 0 and len(p.streamed) == LAYERS + 2
        return
    check_plan(p, 4, budget)
    assert p.ring_bytes == min(RING_TARGET, budget - edges) // 4096 * 4096


def test_the_ring_shrinks_once_the_largest_tensors_are_resident() -> None:
    pre, layers, post = llama(4)
    total, edges, mlp = weights(4)
    attn = 4 * HIDDEN * HIDDEN + 4 * HIDDEN  # q with the input norm, or o with the post-attention norm
    budget = edges + 2 * mlp + 3 * LAYERS * mlp + 8 * MiB  # every MLP matrix beside a ring of two of them
    p = plan_tensors(pre, layers, post, budget, edge_bytes=edges, prefetch=1)  # a ring of two parts
    assert sum(".mlp." in n for n in p.pinned_tensors) == 3 * LAYERS
    assert p.slot_bytes <= attn and p.ring_bytes == 2 * p.slot_bytes  # not two 43 MiB MLP buffers: ...
    assert sum(n.endswith(("q_proj.weight", "o_proj.weight")) for n in p.pinned_tensors) == 3  # ... 3 more resident
    assert p.resident_bytes + p.ring_bytes <= budget


def test_prefetch_zero_and_everything_resident() -> None:
    pre, layers, post = llama(4)
    total, edges, mlp = weights(4)
    p = plan_tensors(pre, layers, post, 512 * MiB, edge_bytes=edges, prefetch=0)
    assert p.ring_bytes == mlp and p.prefetch == 0  # one part at a time: no read overlaps compute
    p = plan_tensors(pre, layers, post, 512 * MiB, edge_bytes=edges, pin=False)
    assert p.pinned_tensors == [] and p.streamed_bytes_per_pass == total - edges
    p = plan_tensors(pre, layers, post, total, edge_bytes=edges)
    assert p.units == [] and p.ring_bytes == 0 and p.pinned == list(range(LAYERS))
    assert p.resident_bytes == total and p.streamed_bytes_per_pass == 0


def test_a_budget_below_the_largest_part_names_it_and_the_budget_needed() -> None:
    pre, layers, post = llama(4)
    _, edges, _ = weights(4)
    head = 4 * VOCAB * HIDDEN + 4 * HIDDEN  # everything streams: the final norm and head is the largest part
    p = plan_tensors(pre, layers, post, head, edge_bytes=edges)
    assert p.resident == [] and p.ring_bytes == head and p.prefetch == 0
    with pytest.raises(BudgetError) as err:
        plan_tensors(pre, layers, post, head - 1, edge_bytes=edges)
    msg = str(err.value)
    assert "final norm and head needs a buffer of 64 MiB (largest tensor 'lm_head.weight', 64 MiB)" in msg, msg
    assert f"a budget of at least 64 MiB ({head} bytes) is needed to stream it" in msg, msg


def test_spread_orders_every_index_once_spread_over_the_range() -> None:
    assert spread(12)[:4] == [0, 6, 3, 9]
    for n in (1, 2, 5, 12, 33):
        assert sorted(spread(n)) == list(range(n))
