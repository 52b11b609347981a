"""EngineConfig.adam_torch_sqrt: the runtime's Adam is kernels.adam's bit-equal mode by default (the
update equals torch.optim.AdamW's, test_training_numerics); False selects its IEEE-sqrt fast mode,
which stays within the bound kernels/fused_adam.py documents."""

from __future__ import annotations

import pytest
from test_training_numerics import ONE, engine_state

from training import Engine


@pytest.mark.parametrize("stage", [1, 3])
def test_the_fast_mode_is_selected_by_the_config_and_tracks_the_bit_equal_mode(stage: int) -> None:
    exact = Engine("tiny", zero_stage=stage, **ONE)
    fast = Engine("tiny", zero_stage=stage, adam_torch_sqrt=False, **ONE)
    assert exact.optimizer.adam.torch_sqrt is True and fast.optimizer.adam.torch_sqrt is False
    init = engine_state(exact, "fp32_master")
    for step in range(4):
        assert exact.train_step(step) == pytest.approx(fast.train_step(step), rel=1e-5)
    a, b = engine_state(exact, "fp32_master"), engine_state(fast, "fp32_master")
    for n in init:  # the relative error of the update (w - w0), as the numerics tests measure it
        moved = (a[n] - init[n]).norm()
        assert moved > 0, n
        assert (a[n] - b[n]).norm() <= 1e-3 * moved, n
