"""ZeroOptimizer.for_module (ZeRO around any nn.Module) with optimizer offload: the same weights, bit for bit,
as without, at every stage, on both tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from training_helpers import module_batch, small_module

from training.adam import AdamConfig
from training.offload import OffloadConfig
from training.zero import ZeroOptimizer


def train(stage: int, offload: OffloadConfig | None) -> list[torch.Tensor]:
    module = small_module()
    opt = ZeroOptimizer.for_module(
        module,
        stage=stage,
        adam=AdamConfig(lr=1e-2, weight_decay=0.1),
        groups=(("*.bias", "norm.*"), ("*",)),
        group_weight_decay=[0.0, None],
        clip=0.5,
        offload=offload,
    )
    try:
        for step in range(4):
            x, y = module_batch(step, 6)
            with opt.forward_context():
                loss = torch.nn.functional.mse_loss(module(x), y)
            opt.backward(loss)
            opt.step()
        if opt.gatherer is not None:
            return [t.clone() for t in opt.param_part]
        return [p.detach().clone() for p in module.parameters()]
    finally:
        opt.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_any_module_trains_the_same_with_offload(tmp_path: Path, stage: int, device: str) -> None:
    section = {"device": device, "nvme_path": str(tmp_path)} if device == "nvme" else {"device": device}
    offload = OffloadConfig.model_validate({"offload_optimizer": section, "sub_group_size": 1})
    got, want = train(stage, offload), train(stage, None)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert list(tmp_path.iterdir()) == []
