"""Adam / AdamW over flat fp32 partitions, with torch.optim's formulas op for op.

ZeRO owns its optimizer state as flat buffers (one per parameter group and rank), so it cannot hand
torch.optim.AdamW per-parameter tensors. This reimplements torch's single-tensor (CPU default)
path exactly — same operations in the same order, python-float bias corrections — so a ZeRO run and
a plain torch run agree to the last bit given the same gradients:

    step += 1
    AdamW: p *= 1 - lr·wd                    Adam: g = g + wd·p
    m.lerp_(g, 1 - β1);  v = v·β2 + (1 - β2)·g²
    denom = sqrt(v) / sqrt(1 - β2^step) + eps
    p -= lr / (1 - β1^step) · m / denom
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class AdamConfig(BaseModel):
    """Hyper-parameters; ``decoupled`` selects AdamW (weight decay applied to the weights, not the gradient)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(1e-3, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    decoupled: bool = True


@torch.no_grad()
def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    cfg: AdamConfig,
    *,
    lr: float | None = None,
    weight_decay: float | None = None,
) -> None:
    """One Adam(W) update in place; ``step`` is the 1-based count *including* this update.

    ``lr``/``weight_decay`` override the config's (schedules, per-group decay).
    """
    lr = cfg.lr if lr is None else lr
    wd = cfg.weight_decay if weight_decay is None else weight_decay
    if wd != 0:
        if cfg.decoupled:
            param.mul_(1 - lr * wd)
        else:
            grad = grad.add(param, alpha=wd)
    exp_avg.lerp_(grad, 1 - cfg.beta1)
    exp_avg_sq.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
    bias_correction1 = 1 - cfg.beta1**step
    bias_correction2 = 1 - cfg.beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
