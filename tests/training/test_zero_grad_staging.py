"""ZeRO-3 lays each gradient into its reduce-scatter input without zeroing the whole buffer first:
the padded tail is zeroed on its own, so a run whose fresh buffers hold garbage (a poisoned
``torch.empty``) ends bit-identical to a clean one, in bf16 compute with a partition alignment."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from training.adam import AdamConfig
from training.zero import ZeroOptimizer


def _run(steps: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 65), nn.Tanh(), nn.Linear(65, 7)).to(torch.bfloat16)
    opt = ZeroOptimizer.for_module(
        model, stage=3, adam=AdamConfig(lr=1e-2, weight_decay=0.1), dtype=torch.bfloat16, alignment=16
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 33, generator=gen), torch.randn(8, 7, generator=gen)
        with opt.forward_context():
            loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        opt.backward(loss)
        opt.step()
    return [t.clone() for t in [*opt.master, *opt.exp_avg, *opt.exp_avg_sq, *opt.param_part]]


def test_stage3_gradient_padding_is_zero_even_in_dirty_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    clean = _run()
    real = torch.empty

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned)
    dirty = _run()
    monkeypatch.undo()
    assert len(clean) == len(dirty)
    for a, b in zip(clean, dirty):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert all(bool(torch.isfinite(t).all()) for t in dirty)
