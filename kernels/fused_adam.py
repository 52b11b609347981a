"""Fused Adam/AdamW over flat fp32 buffers: one pass over memory, optional low-precision copy-back.

``adam(param, grad, exp_avg, exp_avg_sq, step=..., ...)`` updates the fp32 master, both moments and
(``out=``) a bf16/fp16/fp32 copy of the updated weights in a single pass, with the gradient scaled by
``grad_scale`` first (fp16 unscale and clipping coefficient folded into one multiply). The caller
skips overflowed fp16 steps: the kernel has no notion of them (a call always updates).

Numerics (the arithmetic, per element, is torch.optim's single-tensor Adam/AdamW op for op, with
the roundings of torch's vectorised CPU kernels: FMAs in lerp, add(alpha) and addcmul)
* ``torch_sqrt=True``: bit-equal to ``torch.optim.Adam``/``AdamW`` (foreach=False, fused=False) and to
  the op-by-op reference (:func:`adam_reference`), every element, every step. torch computes fp32
  sqrt with MKL's vmsSqrt (``VML_HA``: ≤ 1 ulp, not correctly rounded) where it is built with MKL;
  this mode calls the same routine per cache-resident block. It costs MKL's sqrt (slow on some CPUs).
* ``torch_sqrt=False`` (default, fast): sqrt is IEEE-correctly-rounded, as in torch's fused Adam and
  in every torch built without MKL. Bit-equal to ``torch.optim.AdamW(fused=True)`` on its vector
  lanes (its scalar remainder loop rounds differently). Against the single-tensor path only the sqrt
  differs (MKL's ≤ 1 ulp): one step from the same inputs puts the weights within 4 ulp of
  max(|p|, |Δp|) (measured: 2-4 on 2^20+3 elements, Adam and AdamW, lr 1e-2 and 1e-4, steps 1-100);
  AdamW's moments stay bit-equal (they never read the weights); after 200 steps the weights differ by
  at most 1.2e-4·lr (measured; the tests assert 1e-3·lr).
* bf16/fp16 copy-back equals ``updated_master.to(dtype)`` bit for bit (round to nearest even).
* The pure-torch fallback (no compiler, or ``UCP_KERNELS=torch``) is the op-by-op reference: with
  ``torch_sqrt=True`` it is the same bits; with ``torch_sqrt=False`` it uses the same torch ops (so it
  equals the single-tensor path, not the IEEE-sqrt kernel).
"""

from __future__ import annotations

import math

import torch

from ._build import extension

GRAIN = 1 << 16  # elements per parallel chunk (a chunk is at least this, so small tensors run on one thread)
_COPY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(name: str, t: torch.Tensor, numel: int, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"kernels.adam: {name} is on {t.device}, param on {device}")
    if t.dtype != torch.float32:
        raise ValueError(f"kernels.adam: {name} is {t.dtype}; expected torch.float32")
    if not t.is_contiguous():
        raise ValueError(f"kernels.adam: {name} is not contiguous")
    if t.numel() != numel:
        raise ValueError(f"kernels.adam: {name} has {t.numel()} elements, param has {numel}")


@torch.no_grad()
def adam_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> None:
    """The op-by-op pure-torch update (torch.optim's single-tensor formulas); the fallback path."""
    if grad_scale != 1.0:
        grad = grad.mul(grad_scale)
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if out is not None:
        out.copy_(param)


@torch.no_grad()
def adam(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    torch_sqrt: bool = False,
) -> None:
    """One Adam (``decoupled=False``) or AdamW update in place over flat contiguous fp32 buffers.

    ``step`` is 1-based and counts this update. ``grad`` is read, never written; its effective value
    is ``grad * grad_scale``. ``out`` (bf16, fp16 or fp32, same element count) receives the updated
    weights. ``torch_sqrt`` selects the sqrt that makes the result bit-equal to torch.optim's
    single-tensor path (see the module docstring). Threads: ``torch.get_num_threads()``. CUDA tensors
    run the Triton kernel (:mod:`kernels.triton_adam`; an error if Triton is missing, unless
    ``UCP_KERNELS=torch``), except with ``torch_sqrt``: torch.optim's exact arithmetic on CUDA is
    torch's own CUDA ops, so they take the op-by-op torch path (:func:`adam_reference`), as other
    devices do.
    """
    n = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check(name, t, n, param.device)
    if step < 1:
        raise ValueError(f"kernels.adam: step must be >= 1 (it counts this update), got {step}")
    if out is not None:
        if out.dtype not in _COPY_DTYPES:
            raise ValueError(f"kernels.adam: out is {out.dtype}; expected one of {_COPY_DTYPES}")
        if out.device != param.device or not out.is_contiguous() or out.numel() != n:
            raise ValueError(f"kernels.adam: out must be a contiguous tensor of {n} elements on {param.device}")
    if not (math.isfinite(grad_scale) and math.isfinite(lr)):
        raise ValueError(f"kernels.adam: grad_scale {grad_scale} and lr {lr} must be finite")
    if n == 0:
        return
    if param.device.type == "cuda" and not torch_sqrt:  # Triton (kernels/triton_adam.py, imported on first use)
        from .triton_adam import adam_step, torch_forced

        if not torch_forced():
            adam_step(
                param, grad, exp_avg, exp_avg_sq, out, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, decoupled=decoupled, grad_scale=grad_scale,
            )  # fmt: skip
            return
    ext = extension()[0] if param.device.type == "cpu" else None  # other devices (or UCP_KERNELS=torch): torch ops
    if ext is None:
        adam_reference(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, decoupled=decoupled, grad_scale=grad_scale, out=out,
        )  # fmt: skip
        return
    # Scalars are computed in Python floats exactly as torch.optim computes them, then rounded to
    # fp32 once inside the kernel, as torch rounds a Python scalar for a float tensor.
    decay = 2 if (weight_decay != 0 and not decoupled) else 1
    decay_mul = 1 - lr * weight_decay if (weight_decay != 0 and decoupled) else 1.0
    ext.adam_step(
        param, grad, exp_avg, exp_avg_sq, out if out is not None else torch.empty(0),
        decay, decay_mul, float(weight_decay), 1 - beta1, beta2, 1 - beta2,
        (1 - beta2**step) ** 0.5, eps, -(lr / (1 - beta1**step)), float(grad_scale), bool(torch_sqrt), GRAIN,
    )  # fmt: skip
