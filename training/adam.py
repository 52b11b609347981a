"""Adam / AdamW over flat fp32 partitions, with torch.optim's formulas op for op, on kernels.adam.

ZeRO owns its optimizer state as flat buffers (one per parameter group and rank), so it cannot hand
torch.optim.AdamW per-parameter tensors. The update runs in :func:`kernels.adam`: one pass over
memory (master, moments, and the compute-dtype copy of the weights when ``out`` is given), with
torch's single-tensor (CPU default) arithmetic — same operations, same roundings, python-float bias
corrections:

    step += 1
    AdamW: p *= 1 - lr·wd                    Adam: g = g + wd·p
    m.lerp_(g, 1 - β1);  v = v·β2 + (1 - β2)·g²
    denom = sqrt(v) / sqrt(1 - β2^step) + eps
    p -= lr / (1 - β1^step) · m / denom

``AdamConfig.torch_sqrt`` (default) makes a ZeRO run and a plain torch run agree to the last bit given
the same gradients (torch's own sqrt, MKL's, is used); ``torch_sqrt=False`` takes the IEEE sqrt, as
fast as ``torch.optim.AdamW(fused=True)``, within the bound kernels.fused_adam documents.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

import kernels


class AdamConfig(BaseModel):
    """Hyper-parameters; ``decoupled`` selects AdamW (weight decay applied to the weights, not the gradient)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(1e-3, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    decoupled: bool = True
    torch_sqrt: bool = True  # bit-equal to torch.optim's single-tensor path (False: faster, ≤ a few ulp)


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
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> None:
    """One Adam(W) update in place; ``step`` is the 1-based count *including* this update.

    ``lr``/``weight_decay`` override the config's (schedules, per-group decay). The gradient used is
    ``grad * grad_scale`` (``grad`` itself is not written: one rounding, as ``grad.mul_(grad_scale)``);
    ``out`` receives the updated weights cast to its dtype in the same pass.
    """
    kernels.adam(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step=step,
        lr=cfg.lr if lr is None else lr,
        beta1=cfg.beta1,
        beta2=cfg.beta2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay if weight_decay is None else weight_decay,
        decoupled=cfg.decoupled,
        grad_scale=grad_scale,
        out=out,
        torch_sqrt=cfg.torch_sqrt,
    )
