"""Fused Adam/AdamW on the GPU in Triton: one pass over memory, optional bf16/fp16/fp32 copy-back.

:func:`adam_step` is what ``kernels.adam`` runs for CUDA tensors (after its argument checks): the same
update as the C++ CPU kernel, element for element, with the same scalars (each rounded to fp32 once).

Numerics (per element, in fp32, the C++ kernel's ``torch_sqrt=False`` mode op for op)::

    g = grad * grad_scale
    AdamW: p = p * (1 - lr*wd)   |   Adam: g = fma(p, wd, g)
    m = fma(w, g - m, m)  if w < 0.5 else  fma(w - 1, g - m, g)       (torch's lerp, w = 1 - beta1)
    v = fma((1 - beta2) * g, g, v * beta2)                              (mul_, addcmul_)
    p = p + (-lr / bc1 * m) / (sqrt(v) / sqrt(bc2) + eps)               (bc = 1 - beta^step)

sqrt and division are IEEE-correctly-rounded (``tl.sqrt_rn``, ``tl.div_rn``: Triton's ``tl.sqrt`` is
the approximate one on GPUs), the FMAs are explicit and the kernel is compiled with
``enable_fp_fusion=False`` so the compiler adds none. Hence:

* bit-equal to the C++ CPU kernel with ``torch_sqrt=False`` (asserted under Triton's interpreter in the
  tests; on a GPU by ``tools/gpu_check_kernels.py``);
* against ``torch.optim.AdamW``/``Adam`` single-tensor on the CPU only the sqrt differs (torch's is
  MKL's, ≤ 1 ulp): one step puts the weights within 4 ulp of max(|p|, |Δp|) and over 50 steps they
  differ by < 1e-3·lr (the C++ kernel's documented bound, asserted in the tests);
* against ``torch.optim.AdamW(fused=True)`` on CUDA the formulas differ in rounding only (torch's fused
  kernel computes ``beta1*m + (1-beta1)*g`` rather than a lerp, ``p - lr*wd*p`` rather than
  ``p*(1 - lr*wd)``, and its intermediate precision has changed between releases): the same bound is
  expected and ``tools/gpu_check_kernels.py`` asserts it (not yet run on a GPU when this was written);
* the copy-back equals ``updated_master.to(dtype)`` bit for bit (round to nearest even; bf16 by c10's
  integer formula, which is also exact under the interpreter, whose own fp32→bf16 cast truncates).
  NaN copies are a NaN (payload not preserved for fp16).

``kernels.adam(..., torch_sqrt=True)`` on CUDA tensors does not come here: bit-parity with
torch.optim's single-tensor path on CUDA means torch's own CUDA ops (whose roundings differ from the
CPU's: e.g. CUDA divides by a scalar through its reciprocal), so it takes ``kernels.adam_reference``. The Triton path on CPU tensors exists only for tests, under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
import torch

try:  # optional: torch's CUDA wheels bring Triton; CPU-only installs may lack it
    import triton
    import triton.language as tl

    TRITON_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None
    TRITON_ERROR = f"Triton is not installed ({e})"

BLOCK = 1024  # elements per program: 4 fp32 streams in, 3 out, enough bytes in flight per SM
NUM_WARPS = 4  # 8 elements a thread: two 128-bit accesses per stream (tools/gpu_check_kernels.py sweeps both)
_OUT_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_kernels: dict[tuple[Any, bool], Any] = {}


def available() -> tuple[bool, str]:
    """``(True, version)`` when Triton imports, else ``(False, why)``."""
    if TRITON_ERROR is not None:
        return False, TRITON_ERROR
    return True, f"Triton {triton.__version__}"


def require_triton(what: str) -> None:
    """Raise a clear error naming ``what`` needed Triton when it is not installed."""
    if TRITON_ERROR is not None:
        raise RuntimeError(
            f"{what}: CUDA tensors run the Triton kernels, but {TRITON_ERROR}; install triton "
            "(torch's CUDA wheels depend on it) or set UCP_KERNELS=torch for the op-by-op torch path"
        )


def torch_forced() -> bool:
    """``UCP_KERNELS=torch``: CUDA tensors take the op-by-op torch path instead of Triton."""
    return os.environ.get("UCP_KERNELS", "").strip().lower() == "torch"


def interpreting() -> bool:
    """Whether Triton runs kernels in its numpy interpreter (``TRITON_INTERPRET=1``)."""
    flag = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")
    return TRITON_ERROR is None and flag  # read as triton.jit reads it (triton.knobs, Triton >= 3.4)


def check_device(what: str, t: torch.Tensor) -> None:
    """CUDA tensors, or CPU tensors under the interpreter; anything else is refused by name."""
    if t.device.type == "cuda" or (t.device.type == "cpu" and interpreting()):
        return
    raise ValueError(
        f"{what}: the Triton kernels take CUDA tensors (CPU tensors only under TRITON_INTERPRET=1); got {t.device}"
    )


def jit(fn: Any) -> Any:
    """``triton.jit(fn)``, built on first use for the current mode (compiled or interpreted).

    ``triton.jit`` picks the interpreter when the decorator runs; building lazily, per mode, lets a
    test switch ``TRITON_INTERPRET`` for itself without touching any other test in the process.
    """
    key = (fn, interpreting())
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = triton.jit(fn)
    return k


def fp32(x: float) -> float:
    """``x`` rounded to fp32 (round to nearest even), as the C++ kernel's ``float(x)`` and Triton's
    fp32 scalar arguments round it; returned as a Python float that is exactly that fp32 value."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _adam_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, n,
    decay_mul, decay_add, weight, weight_m1, beta2, omb2, bc2_sqrt, eps, neg_step, grad_scale,
    DECAY: tl.constexpr, SMALL: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # The argument names and the order of operations are the contract of the module docstring.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0) * grad_scale
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    if DECAY == 1:
        p = p * decay_mul
    else:
        g = tl.fma(p, decay_add, g)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    d = g - m
    if SMALL:
        m = tl.fma(d, weight, m)
    else:
        m = tl.fma(d, weight_m1, g)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    v = tl.fma(g * omb2, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(m * neg_step, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if OUT == 1:  # bf16 by c10's round-to-nearest-even on the bits (NaN -> 0x7FC0)
        bits = p.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(p != p, 0x7FC0, r)
        tl.store(o_ptr + offs, r.to(tl.uint16), mask=mask)
    elif OUT == 2:
        tl.store(o_ptr + offs, p.to(tl.float16), mask=mask)
    elif OUT == 3:
        tl.store(o_ptr + offs, p, mask=mask)


@torch.no_grad()
def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float,
) -> None:
    """One Adam(W) update by the Triton kernel, over tensors ``kernels.adam`` has already checked
    (contiguous fp32, equal sizes, one device; ``out`` bf16/fp16/fp32 or None). Tests call it directly
    on CPU tensors under ``TRITON_INTERPRET=1``; anything but CUDA tensors otherwise is refused."""
    require_triton("kernels.adam")
    check_device("kernels.adam", param)
    n = param.numel()
    if n == 0:
        return
    # The C++ kernel's scalars, computed in Python floats as torch.optim does, then rounded to fp32.
    w = fp32(1 - beta1)
    decay = 2 if (weight_decay != 0 and not decoupled) else 1
    decay_mul = fp32(1 - lr * weight_decay) if (weight_decay != 0 and decoupled) else 1.0
    scalars = (
        decay_mul, fp32(weight_decay), w, fp32(np.float32(w) - np.float32(1.0)), fp32(beta2), fp32(1 - beta2),
        fp32((1 - beta2**step) ** 0.5), fp32(eps), fp32(-(lr / (1 - beta1**step))), fp32(grad_scale),
    )  # fmt: skip
    kind = 0 if out is None else _OUT_KIND[out.dtype]
    o = param if out is None else (out.view(torch.uint16) if kind == 1 else out)
    kernel = jit(_adam_kernel)
    consts = dict(DECAY=decay, SMALL=abs(w) < 0.5, OUT=kind, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
    with torch.cuda.device(param.device) if param.is_cuda else contextlib.nullcontext():
        for a, b in split(n):
            t = [x[a:b] for x in (param, grad, exp_avg, exp_avg_sq, o)]
            kernel[(triton.cdiv(b - a, BLOCK),)](*t, b - a, *scalars, **consts)


def split(n: int, align: int = 16) -> list[tuple[int, int]]:
    """``[0, n)`` as a bulk whose length is a multiple of ``align`` and a tail shorter than it.

    Triton vectorises loads and stores (128-bit) only where it can prove the element count divisible
    by 16; an odd-sized partition would run scalar accesses throughout. The tail's own launch costs a
    few microseconds; the bulk's slices start at offsets that keep every pointer 16-byte aligned.
    """
    bulk = n - n % align
    return [(a, b) for a, b in ((0, bulk), (bulk, n)) if b > a]
