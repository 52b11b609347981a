"""The Triton Adam(W) kernel, run on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1`` set per
test): bit-equal to the C++ CPU kernel, within the documented bound of torch.optim, exact copy-back.

Skipped with the reason where Triton is not installed; on a machine with CUDA the last test runs the
real kernel through ``kernels.adam``'s dispatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kernels
from kernels import triton_adam

needs_triton = pytest.mark.skipif(
    not triton_adam.available()[0], reason=f"no Triton here: {triton_adam.available()[1]}"
)
SIZES = (1, 7, 2**16 + 3)  # the interpreter runs each program in numpy: kept small
OUTS = (torch.bfloat16, torch.float16, torch.float32, None)  # one copy-back kind per step, in turn


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton's interpreter for this test only (kernels are built per mode on first use)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_adam.interpreting()
    yield


def _state(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), gen


def _triton(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, **kw: Any) -> None:
    """The Triton path with kernels.adam's defaults (what kernels.adam calls for CUDA tensors)."""
    args: dict[str, Any] = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, grad_scale=1.0)
    args.update(kw)
    out = args.pop("out", None)
    triton_adam.adam_step(p, g, m, v, out, **args)


@needs_triton
@pytest.mark.parametrize("kind", ["adamw", "adam"])
@pytest.mark.parametrize("n", SIZES)
def test_bit_equal_to_the_cpp_kernel_over_steps(interpret: None, cpp_backend: None, kind: str, n: int) -> None:
    """Weight decay, grad_scale and every copy-back dtype, step after step: the same bits as the CPU kernel."""
    p, m, v, gen = _state(n, n)
    q, mq, vq = p.clone(), m.clone(), v.clone()
    kw: dict[str, Any] = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=kind == "adamw")
    for step in range(1, 5):
        g = torch.randn(n, generator=gen) * 64
        dtype = OUTS[(step - 1) % len(OUTS)]
        out = None if dtype is None else torch.empty(n, dtype=dtype)
        out_q = None if dtype is None else torch.empty(n, dtype=dtype)
        _triton(p, g, m, v, step=step, grad_scale=1 / 64, out=out, **kw)
        kernels.adam(q, g, mq, vq, step=step, grad_scale=1 / 64, out=out_q, torch_sqrt=False, **kw)
        assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq), f"{kind} n={n} step {step}"
        if out is not None and out_q is not None:
            assert torch.equal(out.view(torch.uint8), out_q.view(torch.uint8)), f"{kind} n={n} {dtype}"
            assert torch.equal(out.view(torch.uint8), p.to(dtype).view(torch.uint8)), f"{kind} n={n} {dtype}"


@needs_triton
@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_bit_equal_to_the_cpp_kernel_with_a_large_lerp_weight_and_no_decay(
    interpret: None, cpp_backend: None, kind: str
) -> None:
    """beta1 < 0.5 takes torch's other lerp formula; weight_decay 0 skips the decay entirely."""
    n = 4099
    for wd in (0.0, 0.3):
        p, m, v, gen = _state(n, 17)
        q, mq, vq = p.clone(), m.clone(), v.clone()
        kw: dict[str, Any] = dict(lr=3e-3, beta1=0.3, beta2=0.9, eps=1e-6, weight_decay=wd, decoupled=kind == "adamw")
        for step in range(1, 4):
            g = torch.randn(n, generator=gen)
            _triton(p, g, m, v, step=step, **kw)
            kernels.adam(q, g, mq, vq, step=step, torch_sqrt=False, **kw)
            assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq), f"{kind} wd={wd} step {step}"


@needs_triton
@pytest.mark.parametrize("kind", ["adamw", "adam"])
@pytest.mark.parametrize("n", SIZES)
def test_within_the_documented_bound_of_torch_optim(interpret: None, kind: str, n: int) -> None:
    """Each step from torch's own state: within 4 ulp of max(|p|, |Δp|); the runs apart: ≤ 1e-3·lr."""
    lr = 1e-2
    p, m, v, gen = _state(n, 100 + n)
    p.mul_(0.02)
    q = p.clone().requires_grad_()
    Opt = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = Opt([q], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    kw: dict[str, Any] = dict(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=kind == "adamw")
    steps = 4 if n > 1000 else 50
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen) * 1e-3
        before = q.detach().clone()
        if step > 1:  # one step from torch's inputs, as the bound is stated
            one, m1, v1 = before.clone(), opt.state[q]["exp_avg"].clone(), opt.state[q]["exp_avg_sq"].clone()
        q.grad = g.clone()
        opt.step()
        _triton(p, g, m, v, step=step, **kw)
        if step > 1:
            _triton(one, g, m1, v1, step=step, **kw)
            ref = q.detach()
            mag = torch.maximum(ref.abs(), (ref - before).abs())
            ulp = torch.nextafter(mag, torch.tensor(float("inf"))) - mag
            assert bool(((one - ref).abs() <= 4 * ulp).all()), f"{kind} n={n} step {step}"
    assert float((p - q.detach()).abs().max()) <= 1e-3 * lr


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy: fp16 overflow -> inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_back_rounds_like_torch_on_chosen_and_random_bits(interpret: None, dtype: torch.dtype) -> None:
    """lr = 0 leaves the master as it is, so the copy-back casts the bit patterns given: ties to even,
    the largest floats, fp16 overflow and subnormals, signed zeros, infinities, random finite bits."""
    chosen = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001,
         0x477FF000, 0x477FEFFF, 0x38800000, 0x33800000, 0x33800001, 0x7F800000, 0xFF800000, 0x00000000,
         0x80000000, 0x3E99999A, 0x3F7FFFFF, 0x7F7F8000],
        dtype=torch.int64,
    )  # fmt: skip
    rand = torch.randint(0, 2**32, (5000,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    bits = torch.cat([chosen, rand]).to(torch.int32)
    p = bits.view(torch.float32).clone()
    p[~torch.isfinite(p) & ~torch.isinf(p)] = 1.5  # NaNs: checked below
    n = p.numel()
    keep = p.clone()
    out = torch.empty(n, dtype=dtype)
    _triton(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, out=out)
    assert torch.equal(p.view(torch.int32), keep.view(torch.int32))
    assert torch.equal(out.view(torch.int16), p.to(dtype).view(torch.int16))
    nan = torch.full((3,), float("nan"))
    out3 = torch.empty(3, dtype=dtype)
    _triton(nan, torch.zeros(3), torch.zeros(3), torch.zeros(3), step=1, lr=0.0, out=out3)
    assert bool(out3.isnan().all())


@needs_triton
def test_grad_scale_is_folded_into_the_update(interpret: None) -> None:
    """Loss-scaled fp16 gradients with grad_scale = 1/scale (a power of two): the same bits as the
    unscaled gradients, and the gradient is read, never written."""
    n, scale = 1000, 2.0**12  # |randn| < 16: no fp16 overflow
    p, m, v, gen = _state(n, 23)
    q, mq, vq = p.clone(), m.clone(), v.clone()
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).mul(scale).half().float()
        keep = g.clone()
        _triton(p, g, m, v, step=step, lr=1e-3, weight_decay=0.01, grad_scale=1 / scale)
        assert torch.equal(g, keep)
        _triton(q, g / scale, mq, vq, step=step, lr=1e-3, weight_decay=0.01)
        assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq), step


@needs_triton
def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = torch.zeros(4)
    with pytest.raises(ValueError, match=r"take CUDA tensors \(CPU tensors only under TRITON_INTERPRET=1\); got cpu"):
        _triton(t, t.clone(), t.clone(), t.clone(), step=1, lr=0.1)


def test_cuda_without_triton_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Triton: the CUDA path says so and names the way out (the op-by-op torch path)."""
    monkeypatch.setattr(triton_adam, "TRITON_ERROR", "Triton is not installed (No module named 'triton')")
    t = torch.zeros(4)
    with pytest.raises(RuntimeError, match="kernels.adam: CUDA tensors run the Triton kernels, but Triton is not"):
        _triton(t, t.clone(), t.clone(), t.clone(), step=1, lr=0.1)
    with pytest.raises(RuntimeError, match="set UCP_KERNELS=torch for the op-by-op torch path"):
        _triton(t, t.clone(), t.clone(), t.clone(), step=1, lr=0.1)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel runs on a GPU only")
def test_kernels_adam_dispatches_cuda_tensors_to_triton(cpp_backend: None) -> None:
    n = 2**20 + 3
    p, m, v, gen = _state(n, 29)
    g = torch.randn(n, generator=gen)
    kw: dict[str, Any] = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.1)
    dev = [t.cuda() for t in (p, g, m, v)]
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    kernels.adam(*dev, out=out, **kw)
    kernels.adam(p, g, m, v, **kw)
    assert torch.equal(dev[0].cpu(), p) and torch.equal(dev[2].cpu(), m) and torch.equal(dev[3].cpu(), v)
    assert torch.equal(out.cpu(), p.to(torch.bfloat16))
