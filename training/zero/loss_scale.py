"""Dynamic loss scaling for fp16 compute: scale the loss up, skip steps whose gradients overflow.

fp16 has 5 exponent bits, so small gradients underflow to zero; multiplying the loss by ``scale``
moves them into range, and the optimizer divides it out in fp32. An overflow (inf/nan anywhere in
any rank's gradients) skips the step and halves the scale; ``growth_interval`` clean steps in a
row double it. bf16 has fp32's exponent range and needs none of this.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LossScaleConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    initial: float = Field(2.0**16, gt=0)
    growth_interval: int = Field(1000, ge=1)
    factor: float = Field(2.0, gt=1)
    min_scale: float = Field(1.0, gt=0)


class DynamicLossScaler:
    """The current scale and the count of clean steps since the last change."""

    def __init__(self, cfg: LossScaleConfig | None = None) -> None:
        self.cfg = cfg or LossScaleConfig()
        self.scale = float(self.cfg.initial)
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        """After a step: back off on overflow, grow after ``growth_interval`` clean steps."""
        if overflow:
            self.scale = max(self.scale / self.cfg.factor, self.cfg.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
