"""Numerics of the training runtime against plain torch, on the ``tiny`` preset.

Single process: the engine's update is compared bit for bit with ``torch.optim.AdamW`` / ``Adam``
driving an identical copy of the engine's own module (same forward, so the same gradients; the
engine claims torch's formulas op for op), under an lr schedule that starts at 0, for every ZeRO
stage, and in fp16/bf16 with a hand-written mixed-precision loop (fp32 masters, dynamic loss
scaling with skipped steps). Two ranks (gloo, one launch): every ZeRO stage, TP and PP against the
single-process run of the global batch, including the global gradient norm's value, which the
weights alone cannot show (Adam divides any constant gradient scale out again).

Tolerances, where results are not bit-exact: losses agree to 1e-5 relative (fp32 sums in another
order, a few steps). Weights are compared as the relative error of the *update* (w - w0) and Adam's
first moment as a relative L2 error: a handful of elements whose gradient is rounding noise of the
size of eps get an O(lr) update of random sign from Adam's normalisation, so an element-wise atol
would be either meaningless or flaky; the L2 measures stay at ~1e-5..1e-4 here (1e-3 allowed) and a
wrong gradient scale or clip coefficient moves ``exp_avg`` by its full relative size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import covering
from training_helpers import gather, run_world

from reshard import Mesh
from reshard.names import name_matches
from training import Engine
from training.checkpoint import assemble
from training.comm import Comm
from training.engine import EngineConfig
from training.layout import GPT_GROUPS, gpt_shapes
from training.models.gpt import GPT, PRESETS, GPTConfig, batch_for_step
from training.parallel.gpt import build_stage

TINY = PRESETS["tiny"]
ONE = dict(micro_batch=2, seq_len=16, lr=1e-3, weight_decay=0.1, beta2=0.99, eps=1e-7)
STATES = ("fp32_master", "exp_avg", "exp_avg_sq")


def warmup_decay(step: int) -> float:
    """Linear warmup from 0 over 2 steps, then cosine decay: step 0 has lr = 0 (no update, moments still move)."""
    base, warm, total = 3e-3, 2, 6
    if step < warm:
        return base * step / warm
    return base * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))


def no_decay_groups(named: dict[str, torch.nn.Parameter], wd: float) -> list[dict[str, Any]]:
    """The engine's grouping (GPT_GROUPS): biases and layernorms without weight decay."""
    nd = [n for n in named if any(name_matches(p, n) for p in GPT_GROUPS[0])]
    return [
        {"params": [named[n] for n in nd], "weight_decay": 0.0},
        {"params": [p for n, p in named.items() if n not in nd], "weight_decay": wd},
    ]


def twin(engine: Engine) -> torch.nn.Module:
    """A fresh copy of the engine's (tp = pp = 1) module, fp32, with the same initial weights."""
    cfg = engine.cfg.model
    return build_stage(cfg, engine.view, Comm.solo(), list(range(cfg.n_layer)), True, True, engine.cfg.seed)


def engine_state(engine: Engine, section: str) -> dict[str, torch.Tensor]:
    """Global fp32 tensors of one section, reassembled from this (single) rank's checkpoint pieces."""
    targets = engine.checkpoint_targets()
    return {n: assemble(ps, engine.shapes[n])[0] for n, ps in targets.sections[section].items()}


def global_part(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The global tensor's region of a tp = 1 local tensor (drops vocabulary padding rows)."""
    return t.detach()[tuple(slice(0, s) for s in shape)].float()


# -- single process: bit-exact against torch.optim ------------------------------------------------


@pytest.mark.parametrize("stage,kind", covering([0, 1, 2, 3], ["adamw", "adam"]))
def test_update_is_bit_exact_with_torch_optim_under_an_lr_schedule(stage: int, kind: str) -> None:
    engine = Engine("tiny", zero_stage=stage, optimizer=kind, lr_schedule=warmup_decay, **ONE)
    ref = twin(engine)
    named = dict(ref.named_parameters())
    Opt = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = Opt(no_decay_groups(named, ONE["weight_decay"]), lr=ONE["lr"], betas=(0.9, ONE["beta2"]), eps=ONE["eps"])
    init = {n: p.detach().clone() for n, p in named.items()}
    for step in range(4):
        for group in opt.param_groups:
            group["lr"] = warmup_decay(step)
        loss = engine.train_step(step)
        tokens, targets = engine.batch(step, 0)
        opt.zero_grad()
        want = ref(tokens, targets)
        want.backward()
        opt.step()
        assert loss == want.item(), (step, loss, want.item())
        if step == 0 and kind == "adamw":  # lr(0) = 0: AdamW leaves the weights exactly as they were
            masters = engine_state(engine, "fp32_master")
            assert all(torch.equal(masters[n], global_part(init[n], engine.shapes[n])) for n in masters)
    assert engine.optimizer.adam_step == 4
    torch_state = {
        "fp32_master": {n: p for n, p in named.items()},
        "exp_avg": {n: opt.state[p]["exp_avg"] for n, p in named.items()},
        "exp_avg_sq": {n: opt.state[p]["exp_avg_sq"] for n, p in named.items()},
    }
    for section in STATES:
        got = engine_state(engine, section)
        assert set(got) == set(named)
        for n, t in got.items():
            assert torch.equal(t, global_part(torch_state[section][n], engine.shapes[n])), f"{section} {n}"


def test_every_step_gets_the_schedules_lr() -> None:
    engine = Engine("tiny", zero_stage=1, lr_schedule=warmup_decay, **ONE)
    seen: list[float | None] = []
    step = engine.optimizer.step

    def spy(lr: float | None = None) -> dict[str, Any]:
        seen.append(lr)
        return step(lr=lr)

    engine.optimizer.step = spy
    for _ in range(6):
        engine.train_step()
    assert seen == [warmup_decay(s) for s in range(6)]
    assert engine.step == 6


@pytest.mark.parametrize("stage,dtype", covering([0, 1, 2, 3], ["fp16", "bf16"]))
def test_mixed_precision_is_bit_exact_with_a_manual_fp32_master_loop(stage: int, dtype: str) -> None:
    """fp16/bf16 compute weights = fp32 masters cast; gradients unscaled in fp32; fp16 overflow skips the step
    (no Adam step, no weight change), halves the scale, and 2 clean steps double it."""
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    initial = 2.0**17  # overflows on the first step, then runs clean at 2^16 with growth back to 2^17
    engine = Engine(
        "tiny",
        zero_stage=stage,
        dtype=dtype,
        loss_scale={"initial": initial, "growth_interval": 2},
        **{**ONE, "lr": 1e-2},
    )
    ref = twin(engine)
    named = dict(ref.named_parameters())
    masters = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named.items()}
    ref.to(half)
    opt = torch.optim.AdamW(
        no_decay_groups(masters, ONE["weight_decay"]), lr=1e-2, betas=(0.9, ONE["beta2"]), eps=ONE["eps"]
    )
    scale, good, applied, skipped = (initial if dtype == "fp16" else 1.0), 0, 0, []
    for step in range(7):
        before = {s: engine_state(engine, s) for s in ("model", *STATES)}
        loss = engine.train_step(step)
        tokens, targets = engine.batch(step, 0)
        for p in named.values():
            p.grad = None
        want = ref(tokens, targets)
        (want * scale).backward()
        assert all(p.grad is not None for p in named.values())
        grads = {n: p.grad.float() / scale for n, p in named.items() if p.grad is not None}
        overflow = dtype == "fp16" and not all(bool(torch.isfinite(g).all()) for g in grads.values())
        assert loss == want.item()
        assert engine.last_stats["skipped"] == overflow, step
        if overflow:
            skipped.append(step)
            scale, good = scale / 2, 0
            after = {s: engine_state(engine, s) for s in ("model", *STATES)}
            unchanged = all(torch.equal(before[s][n], after[s][n]) for s in after for n in after[s])
            assert unchanged, f"skipped step {step} changed the weights or Adam's state"
        else:
            applied += 1
            good += 1
            if dtype == "fp16" and good == 2:
                scale, good = scale * 2, 0
            for n, m in masters.items():
                m.grad = grads[n]
            opt.step()
            with torch.no_grad():
                for n, p in named.items():
                    p.copy_(masters[n])
        assert engine.optimizer.adam_step == applied
        if dtype == "fp16":
            assert engine.optimizer.scaler is not None and engine.optimizer.scaler.scale == scale, step
    if dtype == "fp16":
        assert skipped and applied >= 3, skipped  # the loop exercised both paths
    got = {s: engine_state(engine, s) for s in ("model", *STATES)}
    want_state = {
        "model": named,
        "fp32_master": masters,
        "exp_avg": {n: opt.state[m]["exp_avg"] for n, m in masters.items()},
        "exp_avg_sq": {n: opt.state[m]["exp_avg_sq"] for n, m in masters.items()},
    }
    for section, tensors in got.items():
        for n, t in tensors.items():
            assert torch.equal(t, global_part(want_state[section][n], engine.shapes[n])), f"{section} {n}"
    for n, t in got["fp32_master"].items():  # the weights are exactly the masters rounded to the compute dtype
        assert torch.equal(got["model"][n], t.to(half).float()), n


# -- single process: accumulation and clipping ------------------------------------------------------


def rel_l2(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None = None
) -> float:
    """||got - want|| / ||want - base|| over all tensors together (base: zeros)."""
    num = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want)
    den = sum(float((want[n] - (base[n] if base else 0)).double().pow(2).sum()) for n in want)
    return math.sqrt(num / den)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_grad_accumulation_equals_the_larger_micro_batch(stage: int) -> None:
    a = Engine("tiny", zero_stage=stage, **{**ONE, "micro_batch": 2}, grad_accum=2, clip=1.0)
    b = Engine("tiny", zero_stage=stage, **{**ONE, "micro_batch": 4}, grad_accum=1, clip=1.0)
    w0 = engine_state(a, "fp32_master")
    for s in range(3):
        la, lb = a.train_step(s), b.train_step(s)
        assert abs(la - lb) <= 1e-5 * lb
        assert abs(a.last_stats["grad_norm"] - b.last_stats["grad_norm"]) <= 1e-5 * b.last_stats["grad_norm"]
    assert rel_l2(engine_state(a, "fp32_master"), engine_state(b, "fp32_master"), w0) < 1e-3
    assert rel_l2(engine_state(a, "exp_avg"), engine_state(b, "exp_avg")) < 1e-4


def test_clipping_matches_clip_grad_norm() -> None:
    """The reported norm is torch's total norm before clipping, and the clipped gradient is what Adam sees."""
    engine = Engine("tiny", zero_stage=2, clip=0.25, **ONE)
    ref = twin(engine)
    named = dict(ref.named_parameters())
    opt = torch.optim.AdamW(
        no_decay_groups(named, ONE["weight_decay"]), lr=ONE["lr"], betas=(0.9, ONE["beta2"]), eps=ONE["eps"]
    )
    for step in range(3):
        engine.train_step(step)
        tokens, targets = engine.batch(step, 0)
        opt.zero_grad()
        ref(tokens, targets).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.25))
        opt.step()
        assert norm > 0.25  # clipping is active
        assert abs(engine.last_stats["grad_norm"] - norm) <= 1e-6 * norm
    want = {n: global_part(opt.state[p]["exp_avg"], engine.shapes[n]) for n, p in named.items()}
    assert rel_l2(engine_state(engine, "exp_avg"), want) < 1e-5


# -- two ranks ----------------------------------------------------------------------------------------


def sc(name: str, mesh: dict[str, int], steps: int = 3, **options: Any) -> dict[str, Any]:
    return {
        "name": name,
        "model": TINY.model_dump(),
        "mesh": mesh,
        "steps": steps,
        "options": {**ONE, "pad_vocab_to": 128, **options},
    }


FP32 = [
    *[sc(f"dp2_z{s}", {"dp": 2}, zero_stage=s, grad_accum=2, clip=0.5) for s in range(4)],
    *[sc(f"tp2_z{s}", {"tp": 2}, zero_stage=s, clip=0.5) for s in (0, 1, 3)],
    sc("pp2_1f1b_z1", {"pp": 2}, zero_stage=1, grad_accum=3, clip=0.5),
    sc("pp2_gpipe_z0", {"pp": 2}, zero_stage=0, grad_accum=3, clip=0.5, pipeline_schedule="gpipe"),
]
HALF = [
    sc(
        f"{d}_dp2_z{s}",
        {"dp": 2},
        steps=4,
        zero_stage=s,
        dtype=d,
        loss_scale={"initial": 2.0**17, "growth_interval": 2},
    )
    for d in ("bf16", "fp16")
    for s in range(4)
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("numerics2")
    run_world(2, FP32 + HALF, out)
    return out


def reference(s: dict[str, Any]) -> dict[str, Any]:
    """One process, the global batch: GPT + torch.optim.AdamW + clip_grad_norm_; per-step losses and norms."""
    cfg = EngineConfig(model=GPTConfig(**s["model"]), mesh=Mesh(**s["mesh"]), **s["options"])
    model = GPT(cfg.model, seed=cfg.seed)
    named = dict(model.named_parameters())
    init = {n: p.detach().clone() for n, p in named.items()}
    opt = torch.optim.AdamW(
        no_decay_groups(named, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )
    losses, norms = [], []
    for step in range(s["steps"]):
        tokens, targets = batch_for_step(step, cfg.global_batch, cfg.seq, cfg.model.vocab_size, cfg.data_seed)
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip or math.inf)))
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "init": init,
        "fp32_master": {n: p.detach() for n, p in named.items()},
        "exp_avg": {n: opt.state[p]["exp_avg"] for n, p in named.items()},
        "exp_avg_sq": {n: opt.state[p]["exp_avg_sq"] for n, p in named.items()},
    }


@pytest.mark.parametrize("s", FP32, ids=[s["name"] for s in FP32])
def test_two_ranks_match_one_process(world2: Path, s: dict[str, Any]) -> None:
    """Losses per step, the global gradient norm (counted once across dp, tp and pp replicas), and the
    weights and Adam moments after the run."""
    g = gather(world2, s["name"], 2, gpt_shapes(TINY))
    ref = reference(s)
    assert not g.cover_problems and g.replicas_agree
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(g.losses, ref["losses"], strict=True)), (g.losses, ref["losses"])
    norms = [r["stats"]["grad_norm"] for r in g.ranks]
    assert norms[0] == norms[1]
    assert abs(norms[0] - ref["norms"][-1]) <= 1e-5 * ref["norms"][-1], (norms[0], ref["norms"][-1])
    assert ref["norms"][-1] > s["options"]["clip"]  # the clip was active, so its coefficient mattered
    state = {k: {n: g.full[(k, n)] for n in ref[k]} for k in STATES}
    assert rel_l2(state["fp32_master"], ref["fp32_master"], ref["init"]) < 1e-3
    assert rel_l2(state["exp_avg"], ref["exp_avg"]) < 1e-4
    assert rel_l2(state["exp_avg_sq"], ref["exp_avg_sq"]) < 1e-4


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_zero_stages_are_bit_identical_in_half_precision(world2: Path, dtype: str) -> None:
    """With one micro-batch every stage sums the same two fp32 gradients and runs the same elementwise
    Adam, so stages 0-3 must agree to the bit (losses, weights, masters, moments)."""
    runs = [gather(world2, f"{dtype}_dp2_z{s}", 2, gpt_shapes(TINY)) for s in range(4)]
    base = runs[0]
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for n in gpt_shapes(TINY):
        assert torch.equal(base.full[("model", n)], base.full[("fp32_master", n)].to(half).float()), n
    for r in runs[1:]:
        assert r.losses == base.losses
        assert set(r.full) == set(base.full)
        assert all(torch.equal(r.full[k], base.full[k]) for k in base.full)
    for r in runs:
        assert {rank["master_dtypes"][0] for rank in r.ranks} == {"torch.float32"}
        assert r.ranks[0]["stats"] == r.ranks[1]["stats"]
