"""ZeRO's update runs in kernels.adam with the clip coefficient folded in and the compute-dtype copy
written in the same pass; in the fast mode (AdamConfig.torch_sqrt=False) a run stays within the
bound kernels.fused_adam documents of a plain torch.optim.AdamW run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from training.adam import AdamConfig
from training.zero import ZeroOptimizer

LR, WD, CLIP = 1e-2, 0.1, 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(33, 65), nn.Tanh(), nn.Linear(65, 7))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("torch_sqrt", [True, False])
def test_zero_with_clipping_tracks_torch_adamw(stage: int, torch_sqrt: bool) -> None:
    ours, ref = _model(), _model()
    opt = ZeroOptimizer.for_module(
        ours, stage=stage, adam=AdamConfig(lr=LR, weight_decay=WD, torch_sqrt=torch_sqrt), clip=CLIP
    )
    topt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    gen = torch.Generator().manual_seed(1)
    clipped = 0
    for _ in range(20):
        x, y = torch.randn(16, 33, generator=gen), torch.randn(16, 7, generator=gen)
        with opt.forward_context():
            loss = nn.functional.mse_loss(ours(x), y)
        opt.backward(loss)
        out = opt.step()
        nn.functional.mse_loss(ref(x), y).backward()
        grads = [q.grad for q in ref.parameters() if q.grad is not None]
        norm = math.sqrt(sum(float(gr.double().pow(2).sum()) for gr in grads))  # as ZeRO: fp64, coefficient
        coef = min(CLIP / (norm + 1e-6), 1.0)  # in Python floats, one multiply of the fp32 gradient
        clipped += int(coef < 1.0)
        for gr in grads:
            gr.mul_(coef)
        topt.step()
        topt.zero_grad()
        assert out["grad_norm"] == pytest.approx(norm, rel=1e-6)
    assert clipped > 10  # the folded clip coefficient was exercised
    want = dict(ref.named_parameters())
    for g, plan in enumerate(opt.plans):  # one rank: the masters are whole, in the plan's order
        for i, name in enumerate(plan.names):
            got = opt.master[g][plan.offsets[i] : plan.offsets[i] + plan.numels[i]]
            ref_flat = want[name].detach().reshape(-1)
            if torch_sqrt:
                assert torch.equal(got, ref_flat), name
            else:
                assert float((got - ref_flat).abs().max()) <= 1e-3 * LR, name
    if stage < 3:  # the copy-back (fp32 here) is the published weights
        for name, p in ours.named_parameters():
            g, i = opt._where[name]
            lo = opt.plans[g].offsets[i]
            assert torch.equal(p.detach().reshape(-1), opt.master[g][lo : lo + p.numel()]), name
