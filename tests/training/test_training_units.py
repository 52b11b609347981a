"""Single-process checks of the training runtime's parts: Adam math, partitions, loss, checkpoint pieces."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from training_helpers import BASE, GQA, PLAIN, reference_run, rel_close, scenario, small_module

import ucp
from reshard import FlatRange, Mesh, Resolver
from training import Engine
from training.adam import AdamConfig, adam_update
from training.checkpoint import assemble, build_targets, fill_from_full, pieces_of
from training.comm import Comm
from training.layout import gpt_layout, gpt_shapes
from training.models.gpt import GPTConfig
from training.parallel.tp import vocab_parallel_cross_entropy
from training.zero import DynamicLossScaler, GroupPlan, LossScaleConfig, ZeroOptimizer


@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_matches_torch_bit_for_bit(decoupled: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(257, generator=gen)
    q = p.clone().requires_grad_()
    Opt = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = Opt([q], lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    cfg = AdamConfig(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-7, weight_decay=0.1, decoupled=decoupled)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 8):
        g = torch.randn(257, generator=gen)
        q.grad = g.clone()
        opt.step()
        adam_update(p, g.clone(), m, v, step, cfg)
    state = opt.state[q]
    assert torch.equal(p, q.detach()) and torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mesh", [Mesh(dp=3), Mesh(tp=2, dp=2), Mesh(tp=2, pp=2, dp=2)], ids=str)
def test_partitions_are_the_layouts(stage: int, mesh: Mesh) -> None:
    """GroupPlan's buffers have the layout's sizes, and every slot the layout gives lies in the right plan slice."""
    cfg = GPTConfig(**GQA)
    layout = gpt_layout(cfg, mesh, zero_stage=stage, zero_alignment=4, pad_vocab_to=8)
    res = Resolver(layout, gpt_shapes(cfg))
    for coord in mesh.coords():
        view = res.view(coord)
        members: list[list[str]] = [[] for _ in layout.zero.groups]
        for n in view.tensors:
            members[layout.zero.group_of(n)].append(n)  # type: ignore[index]
        for g, (names, buf) in enumerate(zip(members, view.zero_groups)):
            plan = GroupPlan(g, stage, tuple(names), tuple(view.tensors[n].shape for n in names), mesh.dp, coord.dp, 4)
            assert buf.shape == (plan.size,)
            for s in buf.slots:
                assert isinstance(s.local, FlatRange)
                hits = [sl for sl in plan.slices if sl.offset <= s.local.start and s.local.stop <= sl.offset + sl.numel]
                assert len(hits) == 1 and plan.names[hits[0].param] == s.tensor


def test_vocab_parallel_cross_entropy_ignores_padding_columns() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 13, generator=gen, requires_grad=True)  # 10 real columns, 3 padding
    target = torch.randint(0, 10, (6,), generator=gen)
    loss = vocab_parallel_cross_entropy(logits, target, 0, 10, Comm.solo())
    loss.backward()
    ref_logits = logits.detach()[:, :10].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target)
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-6)
    assert logits.grad is not None and ref_logits.grad is not None
    assert torch.allclose(logits.grad[:, :10], ref_logits.grad, atol=1e-7)
    assert torch.equal(logits.grad[:, 10:], torch.zeros(6, 3))


def test_fused_tensors_are_one_piece_at_tp1_and_one_per_part_at_tp2() -> None:
    cfg = GPTConfig(**GQA)
    shapes = gpt_shapes(cfg)
    name = "layers.0.attn.qkv.weight"
    for tp, expect in ((1, 1), (2, 3)):
        view = gpt_layout(cfg, Mesh(tp=tp), pad_vocab_to=8).resolve(shapes, 0)
        buf = view.tensors[name]
        pieces = pieces_of(torch.zeros(buf.shape), buf, shapes)
        assert len(pieces) == expect
        if tp == 1:
            part = pieces[0][1]
            assert isinstance(part, ucp.ShardedTensor) and part.box.shape == shapes[name]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_single_process_engine_matches_plain_torch(stage: int) -> None:
    sc = scenario("solo", GQA if stage % 2 else PLAIN, {}, steps=3, zero_stage=stage, grad_accum=2, clip=0.5)
    engine = Engine(GPTConfig(**sc["model"]), mesh={}, **sc["options"])
    losses = [engine.train_step(s) for s in range(3)]
    ref = reference_run(sc)
    assert rel_close(losses, ref.losses, 1e-5)
    targets = engine.checkpoint_targets()
    for name, want in ref.params.items():
        got, count = assemble(targets.sections["fp32_master"][name], want.shape)
        assert torch.equal(count, torch.ones_like(count)) and torch.allclose(got, want, atol=1e-4), name


def test_zero3_gathers_only_around_use() -> None:
    engine = Engine(GPTConfig(**PLAIN), zero_stage=3, **BASE)
    params = list(engine.model.parameters())
    assert all(p.numel() == 0 for p in params)  # partitioned from the start
    engine.train_step(0)
    gatherer = engine.optimizer.gatherer
    assert gatherer is not None and gatherer.gathers > 0 and gatherer.packed > 0
    assert all(p.numel() == 0 for p in params) and not list(gatherer.gathered())
    tokens, targets = engine.batch(1, 0)
    assert math.isfinite(engine.eval_loss(tokens, targets))
    assert all(p.numel() == 0 for p in params)


def test_fp16_overflow_skips_the_step_and_backs_off() -> None:
    module = small_module().half()
    opt = ZeroOptimizer.for_module(
        module,
        stage=1,
        adam=AdamConfig(lr=1e-2),
        dtype=torch.float16,
        loss_scaler=DynamicLossScaler(LossScaleConfig(initial=1024.0, growth_interval=2)),
    )
    before = [t.clone() for t in opt.master]
    x = torch.randn(4, 7).half()
    with opt.forward_context():
        loss = module(x).float().pow(2).mean() * 1e30  # overflows fp16 once scaled
    opt.backward(loss)
    stats = opt.step()
    assert stats["skipped"] and opt.scaler.scale == 512.0 and opt.adam_step == 0  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master))
    for _ in range(2):
        with opt.forward_context():
            loss = module(x).float().pow(2).mean()
        opt.backward(loss)
        assert not opt.step()["skipped"]
    assert opt.adam_step == 2 and opt.scaler.scale == 1024.0  # type: ignore[union-attr]
    assert all(t.dtype == torch.float32 for t in opt.master)
    assert not any(torch.equal(a, b) for a, b in zip(before, opt.master))


def test_ucp_round_trip_between_zero_stages(tmp_path) -> None:
    """tp = 1: the nested state dict saves with ucp as is, and loads into another stage and precision."""
    cfg = GPTConfig(**GQA)
    a = Engine(cfg, zero_stage=1, dtype="bf16", **BASE)
    for s in range(2):
        a.train_step(s)
    ucp.save(a.state_dict_for_checkpoint(), tmp_path / "ck")
    b = Engine(cfg, zero_stage=3, zero_alignment=4, dtype="fp32", **BASE)
    state = b.state_dict_for_checkpoint()
    ucp.load(tmp_path / "ck", into=state)
    b.finish_load(state)
    assert b.step == 2 and b.optimizer.adam_step == 2
    for name, pieces in b.checkpoint_targets().sections["fp32_master"].items():
        want = assemble(a.checkpoint_targets().sections["fp32_master"][name], pieces[0].global_shape)[0]
        assert torch.equal(assemble(pieces, want.shape)[0], want), name
    # both continue with the same fp32 masters; bf16 vs fp32 compute keeps the losses close, not equal
    assert abs(a.train_step() - b.train_step()) < 2e-2


def test_weights_only_load_rebuilds_masters() -> None:
    cfg = GPTConfig(**PLAIN)
    a = Engine(cfg, zero_stage=2, **BASE)
    a.train_step(0)
    full = {n: assemble(ps, a.shapes[n])[0] for n, ps in a.checkpoint_targets().sections["model"].items()}
    b = Engine(cfg, zero_stage=0, **BASE)
    fill_from_full(b.checkpoint_targets(), lambda section, name: full[name] if section == "model" else None)
    b.finish_load({"step": 1}, from_masters=False)
    got = {n: assemble(ps, a.shapes[n])[0] for n, ps in b.checkpoint_targets().sections["fp32_master"].items()}
    assert all(torch.equal(got[n], full[n]) for n in full)


def test_configuration_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="ZeRO stages 0 and 1"):
        Engine(GPTConfig(**PLAIN), mesh={"pp": 2}, zero_stage=2)
    module = small_module()
    from training.layout import module_layout

    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    shapes = dict(reversed(shapes.items()))
    layout = module_layout(1, zero_stage=1)
    view = Resolver(layout, shapes).view(0)
    with pytest.raises(ValueError, match="names and order must match"):
        ZeroOptimizer(module, layout, view, dp=Comm.solo(), world=Comm.solo(), adam=AdamConfig())


def test_checkpoint_targets_view_live_storage() -> None:
    engine = Engine(GPTConfig(**PLAIN), zero_stage=1, **BASE)
    targets = build_targets(engine.optimizer.buffers(), engine.shapes)
    piece = targets.sections["fp32_master"]["ln_f.weight"][0]
    piece.local.fill_(7.0)
    assert bool((engine.optimizer.master[0] == 7.0).any())
