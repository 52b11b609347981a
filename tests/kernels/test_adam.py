"""kernels.adam against torch.optim.Adam/AdamW: bit-equal (torch_sqrt), the IEEE-sqrt bound, copy-back,
fp16 loss scaling with a skipped step, odd sizes, thread counts and chunk boundaries, the fallback."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import kernels
from kernels import _build

fused_adam = sys.modules["kernels.fused_adam"]
SIZES = (1, 7, 2**20 + 3)
HP: dict[str, Any] = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _torch_opt(
    kind: str, q: torch.Tensor, betas: tuple[float, float] = (0.9, 0.95), **kw: object
) -> torch.optim.Optimizer:
    Opt = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    args = {**HP, "betas": betas, **kw}
    return Opt([q], foreach=False, **args)


def _run_against_torch(kind: str, n: int, steps: int, *, beta1: float = 0.9, torch_sqrt: bool = True) -> None:
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    q = p.clone().requires_grad_()
    opt = _torch_opt(kind, q, betas=(beta1, 0.95))
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen)
        q.grad = g.clone()
        opt.step()
        kernels.adam(
            p, g, m, v, step=step, lr=1e-2, beta1=beta1, beta2=0.95, eps=1e-8, weight_decay=0.1,
            decoupled=kind == "adamw", torch_sqrt=torch_sqrt,
        )  # fmt: skip
        st = opt.state[q]
        assert torch.equal(p, q.detach()), f"{kind} n={n} step {step}: param"
        assert torch.equal(m, st["exp_avg"]) and torch.equal(v, st["exp_avg_sq"]), f"{kind} n={n} step {step}"


@pytest.mark.parametrize("kind", ["adamw", "adam"])
@pytest.mark.parametrize("n", SIZES)
def test_bit_equal_to_torch_optim_single_tensor_over_many_steps(cpp_backend: None, kind: str, n: int) -> None:
    _run_against_torch(kind, n, steps=40 if n > 1000 else 200)


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_bit_equal_with_a_large_lerp_weight(cpp_backend: None, kind: str) -> None:
    """beta1 < 0.5 makes torch's lerp take its other formula (end - (end - start)·(1 - w))."""
    _run_against_torch(kind, 4099, steps=50, beta1=0.3)


@pytest.mark.parametrize("kind", ["adamw", "adam"])
@pytest.mark.parametrize("n", SIZES)
def test_fallback_is_bit_equal_to_torch_optim(torch_backend: None, kind: str, n: int) -> None:
    assert kernels.backend().startswith("torch: UCP_KERNELS=torch")
    _run_against_torch(kind, n, steps=30, torch_sqrt=False)


def test_a_missing_compiler_falls_back_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCP_KERNELS", raising=False)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    _build.reset()
    try:
        why = kernels.backend()
        assert why.startswith("torch: C++ extension unavailable (no C++ compiler ('/nonexistent/c++'"), why
        p, g, m, v = torch.ones(5), torch.ones(5), torch.zeros(5), torch.zeros(5)
        out = torch.empty(5, dtype=torch.bfloat16)
        kernels.adam(p, g, m, v, step=1, lr=0.1, out=out)
        assert torch.equal(out, p.to(torch.bfloat16)) and torch.allclose(p, torch.full((5,), 0.9))
    finally:
        monkeypatch.delenv("CXX")
        _build.reset()


def test_forcing_cpp_without_a_compiler_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCP_KERNELS", "cpp")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    _build.reset()
    try:
        with pytest.raises(RuntimeError, match="UCP_KERNELS=cpp but the C\\+\\+ extension could not be built"):
            kernels.backend()
    finally:
        monkeypatch.delenv("CXX")
        _build.reset()


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_ieee_sqrt_stays_within_the_documented_bound(cpp_backend: None, kind: str) -> None:
    """Default mode: per step within 4 ulp of max(|p|, |Δp|) of the torch_sqrt result; ≤ 1e-3·lr after 200."""
    n, lr = 2**20 + 3, 1e-2
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen) * 0.02
    q, m, v, mq, vq = p.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    kw: dict[str, Any] = dict(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=kind == "adamw")
    for step in range(1, 201):
        g = torch.randn(n, generator=gen) * 1e-3
        if step in (1, 100):  # one step from identical inputs
            a, b = (p.clone(), m.clone(), v.clone()), (p.clone(), m.clone(), v.clone())
            kernels.adam(a[0], g, a[1], a[2], step=step, **kw)
            kernels.adam(b[0], g, b[1], b[2], step=step, torch_sqrt=True, **kw)
            mag = torch.maximum(b[0].abs(), (b[0] - p).abs())
            ulp = torch.nextafter(mag, torch.tensor(float("inf"))) - mag
            assert bool(((a[0] - b[0]).abs() <= 4 * ulp).all()), f"step {step}"
        kernels.adam(p, g, m, v, step=step, **kw)
        kernels.adam(q, g, mq, vq, step=step, torch_sqrt=True, **kw)
    assert float((p - q).abs().max()) <= 1e-3 * lr
    if kind == "adamw":  # the moments never read the weights
        assert torch.equal(m, mq) and torch.equal(v, vq)


def test_ieee_sqrt_is_bit_equal_to_torch_fused_adamw_on_its_vector_lanes(cpp_backend: None) -> None:
    n = 4096
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen)
    q = p.clone().requires_grad_()
    opt = torch.optim.AdamW([q], fused=True, **HP)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 51):
        g = torch.randn(n, generator=gen)
        q.grad = g.clone()
        opt.step()
        kernels.adam(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        assert torch.equal(p, q.detach()) and torch.equal(m, opt.state[q]["exp_avg"]), step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("backend", ["cpp_backend", "torch_backend"])
def test_copy_back_equals_the_cast_of_the_updated_master(
    request: pytest.FixtureRequest, backend: str, dtype: torch.dtype
) -> None:
    request.getfixturevalue(backend)
    n = 2**20 + 3
    gen = torch.Generator().manual_seed(7)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=dtype)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen)
        kernels.adam(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1, out=out)
        assert torch.equal(out.view(-1).view(torch.uint8), p.to(dtype).view(torch.uint8)), step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_back_rounds_ties_to_even_and_handles_the_edges(cpp_backend: None, dtype: torch.dtype) -> None:
    """lr = 0 leaves the master as it is, so the copy-back casts chosen bit patterns."""
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001,
         0x477FF000, 0x477FEFFF, 0x38800000, 0x33800000, 0x33800001, 0x7F800000, 0xFF800000, 0x00000000,
         0x80000000, 0x3E99999A],
        dtype=torch.int64,
    ).to(torch.int32)  # fmt: skip
    p = bits.view(torch.float32).clone()
    n = p.numel()
    out = torch.empty(n, dtype=dtype)
    kernels.adam(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, out=out)
    assert torch.equal(p.view(torch.int32), bits)
    assert torch.equal(out.view(torch.int16), p.to(dtype).view(torch.int16))
    nan = torch.full((3,), float("nan"))
    out3 = torch.empty(3, dtype=dtype)
    kernels.adam(nan, torch.zeros(3), torch.zeros(3), torch.zeros(3), step=1, lr=0.0, out=out3)
    assert bool(out3.isnan().all())


@pytest.mark.parametrize("n", [7, 2**20 + 3])
@pytest.mark.parametrize("grain", [1, 4099, 65536])
def test_thread_counts_and_unaligned_chunks_give_the_same_bits(
    cpp_backend: None, threads: None, monkeypatch: pytest.MonkeyPatch, n: int, grain: int
) -> None:
    monkeypatch.setattr(fused_adam, "GRAIN", grain)
    gen = torch.Generator().manual_seed(11)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m0, v0 = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    results = []
    for t in (1, 2, 3, 4):
        torch.set_num_threads(t)
        for torch_sqrt in (False, True):
            p, m, v, out = p0.clone(), m0.clone(), v0.clone(), torch.empty(n, dtype=torch.bfloat16)
            kernels.adam(p, g, m, v, step=3, lr=1e-3, weight_decay=0.01, out=out, torch_sqrt=torch_sqrt)
            results.append((torch_sqrt, p, m, v, out))
    ref = p0.clone(), m0.clone(), v0.clone()
    fused_adam.adam_reference(ref[0], g, ref[1], ref[2], step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.01)  # fmt: skip
    for torch_sqrt, p, m, v, out in results:
        same = [r for r in results if r[0] == torch_sqrt][0]
        assert all(torch.equal(a, b) for a, b in zip((p, m, v, out), same[1:]))
        if torch_sqrt:
            assert torch.equal(p, ref[0]) and torch.equal(m, ref[1]) and torch.equal(v, ref[2])


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_fp16_loss_scaling_with_an_overflow_skipped_step(cpp_backend: None, kind: str) -> None:
    """The caller unscales through grad_scale and skips an overflowed step (the kernel is not called);
    the run equals torch.optim fed the unscaled gradients with that step left out."""
    n, scale = 1000, 2.0**12
    gen = torch.Generator().manual_seed(13)
    p = torch.randn(n, generator=gen)
    q = p.clone().requires_grad_()
    opt = _torch_opt(kind, q)
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.float16)
    step, skipped = 0, 0
    for it in range(12):
        scaled = (torch.randn(n, generator=gen) * scale).half()
        if it == 5:
            scaled[17] = float("inf")
        grad = scaled.float()
        if not bool(torch.isfinite(grad).all()):
            skipped += 1
            continue
        before = p.clone()
        step += 1
        kernels.adam(p, grad, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                     decoupled=kind == "adamw", grad_scale=1 / scale, out=out, torch_sqrt=True)  # fmt: skip
        assert not torch.equal(p, before)
        q.grad = grad.mul(1 / scale)
        opt.step()
        assert torch.equal(p, q.detach()) and torch.equal(out, p.half()), it
    assert skipped == 1 and step == 11
    assert torch.equal(m, opt.state[q]["exp_avg"]) and torch.equal(v, opt.state[q]["exp_avg_sq"])


def test_grad_is_read_not_written_and_empty_is_a_no_op(cpp_backend: None) -> None:
    g = torch.randn(100)
    keep = g.clone()
    kernels.adam(torch.randn(100), g, torch.zeros(100), torch.zeros(100), step=1, lr=0.1, grad_scale=0.5)
    assert torch.equal(g, keep)
    e = torch.empty(0)
    kernels.adam(e, e, e, e, step=1, lr=0.1)


def test_bad_arguments_name_the_tensor_at_fault(cpp_backend: None) -> None:
    p, g, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="exp_avg_sq is torch.float64"):
        kernels.adam(p, g, m, v.double(), step=1, lr=0.1)
    with pytest.raises(ValueError, match="grad has 7 elements, param has 8"):
        kernels.adam(p, g[:7], m, v, step=1, lr=0.1)
    with pytest.raises(ValueError, match="exp_avg is not contiguous"):
        kernels.adam(p, g, torch.zeros(16)[::2], v, step=1, lr=0.1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        kernels.adam(p, g, m, v, step=0, lr=0.1)
    with pytest.raises(ValueError, match="out is torch.int8"):
        kernels.adam(p, g, m, v, step=1, lr=0.1, out=torch.zeros(8, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("torch_sqrt", [False, True])
def test_a_large_copy_back_at_an_unaligned_start_equals_the_cast(
    cpp_backend: None, threads: None, dtype: torch.dtype, torch_sqrt: bool
) -> None:
    """A copy-back of more than 4 MiB, over 1 and 2 threads, starting at an odd address; nothing around it moves."""
    n = 2**21 + 5
    gen = torch.Generator().manual_seed(11)
    for t in (1, 2):
        torch.set_num_threads(t)
        p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
        buf = torch.zeros(n + 9, dtype=dtype)
        out = buf[3 : 3 + n]
        for step in range(1, 3):
            g = torch.randn(n, generator=gen)
            kernels.adam(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1, out=out, torch_sqrt=torch_sqrt)
            assert torch.equal(out.view(torch.uint8), p.to(dtype).view(torch.uint8)), (t, step)
        assert not buf[:3].any() and not buf[3 + n :].any()
