"""Check the Triton kernels on a GPU: correctness, then GB/s beside torch's fused AdamW and a memcpy.

Prepared for a short session on a lent GPU machine (well under 2 minutes on an H200)::

    python tools/gpu_check_kernels.py                  # 100M parameters, 10 timed repeats
    python tools/gpu_check_kernels.py --json out.json  # also write the summary there

Needs torch with CUDA, triton (torch's CUDA wheels bring it) and the project's dependencies (crc32c).

Correctness (a failure exits 1):
* the compiled Triton Adam(W) kernel, reached through ``kernels.adam``'s CUDA dispatch, against the
  same kernel run by Triton's interpreter on the CPU (which the CPU tests prove bit-equal to the C++
  kernel): bit-equal weights, moments and bf16/fp16 copy-back, Adam and AdamW, 3 steps, odd size;
* against ``torch.optim.AdamW(fused=True)`` on CUDA: one step from torch's own state within 4 ulp of
  max(|p|, |Δp|) (the documented bound), and the runs ≤ 1e-3·lr apart after 20 steps;
* ``kernels.adam(torch_sqrt=True)`` on CUDA (torch's own ops) bit-equal to ``torch.optim.AdamW(foreach=False)``;
* ``kernels.cast_flatten`` (dispatched to Triton) of 300 mixed-dtype tensors bit-equal to ``Tensor.to``.

Speed (CUDA events, medians of ``--repeats``; and a sweep of the Adam launch shape): GB/s of state touched per Adam step (fp32 param, grad,
exp_avg, exp_avg_sq read; param and moments written: 28 bytes/parameter, +2 for a bf16 copy-back) for
ours, ours with bf16 copy-back, torch's fused AdamW, and that plus torch's separate ``.to(bf16)`` copy;
a device-to-device memcpy of the same footprint (read + write) as the yardstick; cast_flatten fp32→bf16
of 400 tensors (6 bytes/element) against a ``copy_`` per tensor. One JSON object, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

import torch  # noqa: E402

from tools.argtypes import positive_int  # noqa: E402

DEV = "cuda"
HP: dict[str, Any] = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=positive_int, default=100_000_000, help="parameters timed (default 100M)")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed repeats per case (median)")
    p.add_argument("--check-size", type=positive_int, default=(1 << 16) + 3, help="elements in the bit-exact check")
    p.add_argument("--bound-size", type=positive_int, default=1 << 22, help="elements in the torch-fused check")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON summary to this file")
    a = p.parse_args(argv)
    if a.json is not None and not a.json.parent.is_dir():
        p.error(f"--json: directory {a.json.parent} does not exist")
    return a


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` (after 2 warm-up calls), by CUDA events."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def check_vs_interpreter(n: int) -> dict[str, Any]:
    """The compiled kernel (via kernels.adam) against Triton's interpreter on the CPU: mismatching elements."""
    import kernels
    from kernels import triton_adam

    gen = torch.Generator().manual_seed(1)
    bad: dict[str, int] = {}
    for kind in ("adamw", "adam"):
        p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
        dev = [t.to(DEV, copy=True) for t in (p, m, v)]
        for step, dtype in enumerate((torch.bfloat16, torch.float16, None), start=1):
            g = torch.randn(n, generator=gen) * 64
            kw = dict(HP, step=step, decoupled=kind == "adamw", grad_scale=1 / 64)
            out = None if dtype is None else torch.empty(n, dtype=dtype)
            out_d = None if dtype is None else torch.empty(n, dtype=dtype, device=DEV)
            kernels.adam(dev[0], g.to(DEV), dev[1], dev[2], out=out_d, **kw)
            before = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"  # the kernels are built per mode: this one runs interpreted
            try:
                triton_adam.adam_step(p, g, m, v, out, **kw)
            finally:
                if before is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = before
            for name, a, b in (("param", p, dev[0]), ("exp_avg", m, dev[1]), ("exp_avg_sq", v, dev[2])):
                bad[f"{kind} step {step} {name}"] = int((a.view(torch.int32) != b.cpu().view(torch.int32)).sum())
            if out is not None and out_d is not None:
                bad[f"{kind} step {step} {dtype}"] = int((out.view(torch.int16) != out_d.cpu().view(torch.int16)).sum())
    return {"mismatching_elements": sum(bad.values()), "cases": len(bad), "worst": max(bad.items(), key=lambda x: x[1])}


def check_vs_torch_fused(n: int) -> dict[str, Any]:
    """Ours against torch.optim.AdamW(fused=True): the one-step ulp bound and the 20-step distance."""
    import kernels

    gen = torch.Generator(device=DEV).manual_seed(2)
    p = torch.randn(n, device=DEV, generator=gen) * 0.02
    q = p.clone().requires_grad_()
    opt = torch.optim.AdamW([q], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)  # fmt: skip
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    worst_ulp = 0.0
    for step in range(1, 21):
        g = torch.randn(n, device=DEV, generator=gen) * 1e-3
        before = q.detach().clone()
        if step > 1:
            one, m1, v1 = before.clone(), opt.state[q]["exp_avg"].clone(), opt.state[q]["exp_avg_sq"].clone()
        q.grad = g.clone()
        opt.step()
        kernels.adam(p, g, m, v, step=step, **HP)
        if step > 1:
            kernels.adam(one, g, m1, v1, step=step, **HP)
            ref = q.detach()
            mag = torch.maximum(ref.abs(), (ref - before).abs())
            ulp = torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag
            worst_ulp = max(worst_ulp, float(((one - ref).abs() / ulp).max()))
    dist = float((p - q.detach()).abs().max()) / HP["lr"]
    return {"one_step_max_ulp": round(worst_ulp, 3), "after_20_steps_max_diff_over_lr": dist,
            "ok": worst_ulp <= 4 and dist <= 1e-3}  # fmt: skip


def check_torch_sqrt_parity(n: int) -> dict[str, Any]:
    """kernels.adam(torch_sqrt=True) on CUDA (torch's ops) against torch.optim.AdamW(foreach=False): bits."""
    import kernels

    gen = torch.Generator(device=DEV).manual_seed(4)
    p = torch.randn(n, device=DEV, generator=gen)
    q = p.clone().requires_grad_()
    opt = torch.optim.AdamW([q], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=False)  # fmt: skip
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    bad = 0
    for step in range(1, 11):
        g = torch.randn(n, device=DEV, generator=gen)
        q.grad = g.clone()
        opt.step()
        kernels.adam(p, g, m, v, step=step, torch_sqrt=True, **HP)
        bad += int((p.view(torch.int32) != q.detach().view(torch.int32)).sum())
    return {"mismatching_elements": bad, "steps": 10}


def check_cast_flatten() -> dict[str, Any]:
    """kernels.cast_flatten (dispatched to Triton) of 300 mixed-dtype tensors, odd sizes, into each dtype."""
    import kernels

    gen = torch.Generator(device=DEV).manual_seed(3)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    ts = [(torch.randn(1 + 997 * i % 50000, device=DEV, generator=gen) * 100).to(dtypes[i % 3]) for i in range(300)]
    bad = 0
    for dst in dtypes:
        out = torch.zeros(sum(t.numel() for t in ts) + 7, dtype=dst, device=DEV)
        kernels.cast_flatten(ts, out)
        want = torch.cat([t.to(dst).flatten() for t in ts])
        bad += int((out[: want.numel()].view(torch.uint8) != want.view(torch.uint8)).sum())
        bad += int((out[want.numel() :] != 0).sum())
    return {"mismatching_bytes": bad, "tensors": len(ts)}


def memcpy_seconds(n: int, repeats: int) -> float:
    """Median seconds of a device-to-device copy of ``n`` fp32 elements (read + write)."""
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), repeats)


def bench(n: int, repeats: int) -> dict[str, Any]:
    import kernels

    dev = DEV
    p, g = torch.randn(n, device=dev), torch.randn(n, device=dev) * 1e-3
    m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    step = [0]

    def ours(o: torch.Tensor | None) -> Callable[[], None]:
        def run() -> None:
            step[0] += 1
            kernels.adam(p, g, m, v, step=step[0], out=o, **HP)

        return run

    q = torch.randn(n, device=dev).requires_grad_()
    q.grad = g.clone()
    opt = torch.optim.AdamW([q], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)  # fmt: skip
    qb = torch.empty(n, dtype=torch.bfloat16, device=dev)

    def torch_copy() -> None:
        opt.step()
        qb.copy_(q.detach())

    sec = {
        "ours_adam": timed(ours(None), repeats),
        "ours_adam_bf16_copy": timed(ours(out), repeats),
        "torch_fused_adamw": timed(opt.step, repeats),
        "torch_fused_adamw_then_bf16_copy": timed(torch_copy, repeats),
        "memcpy_d2d": memcpy_seconds(7 * n, repeats),  # 28 bytes/parameter: Adam's footprint, moved once
    }
    moved = {"ours_adam": 28, "ours_adam_bf16_copy": 30, "torch_fused_adamw": 28,
             "torch_fused_adamw_then_bf16_copy": 34, "memcpy_d2d": 56}  # fmt: skip
    k = 400
    ts = list(torch.randn(n, device=dev).split(n // k)[:k])
    flat = torch.empty(sum(t.numel() for t in ts), dtype=torch.bfloat16, device=dev)
    offs = [0]
    for t in ts[:-1]:
        offs.append(offs[-1] + t.numel())
    sec["cast_flatten_400_fp32_to_bf16"] = timed(lambda: kernels.cast_flatten(ts, flat), repeats)

    def per_tensor() -> None:
        for t, a in zip(ts, offs):
            flat[a : a + t.numel()].copy_(t)

    sec["torch_copy_per_tensor_400"] = timed(per_tensor, repeats)
    moved["cast_flatten_400_fp32_to_bf16"] = moved["torch_copy_per_tensor_400"] = 6
    elems = {name: (flat.numel() if "400" in name else n) for name in sec}
    from kernels import triton_adam

    keep = triton_adam.BLOCK, triton_adam.NUM_WARPS
    try:  # the launch shape, for tuning: (elements per program, warps) -> ms of one AdamW step
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
            triton_adam.BLOCK, triton_adam.NUM_WARPS = block, warps
            name = f"ours_adam_block{block}_warps{warps}"
            sec[name], moved[name], elems[name] = timed(ours(None), repeats), 28, n
    finally:
        triton_adam.BLOCK, triton_adam.NUM_WARPS = keep
    return {
        name: {"ms": round(s * 1e3, 3), "gb_per_s": round(moved[name] * elems[name] / s / 1e9, 1)}
        for name, s in sec.items()
    }


def markdown(summary: dict[str, Any]) -> str:
    rows = ["| case | ms | GB/s |", "|---|---:|---:|"]
    rows += [f"| {k} | {v['ms']} | {v['gb_per_s']} |" for k, v in summary["speed"].items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check_kernels: no CUDA device here; nothing to check (run it on a GPU machine)", file=sys.stderr)
        return 2
    from kernels import triton_adam

    ok, why = triton_adam.available()
    if not ok:
        print(f"gpu_check_kernels: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    summary: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": why,
                               "params": a.params, "repeats": a.repeats}  # fmt: skip
    summary["vs_interpreter"] = check_vs_interpreter(a.check_size)
    summary["vs_torch_fused"] = check_vs_torch_fused(a.bound_size)
    summary["torch_sqrt_parity"] = check_torch_sqrt_parity(a.check_size)
    summary["cast_flatten"] = check_cast_flatten()
    summary["speed"] = bench(a.params, a.repeats)
    ms = {k: max(v["ms"], 1e-6) for k, v in summary["speed"].items()}
    summary["ratios"] = {  # speed ratios (> 1: ours faster) and the share of memcpy bandwidth reached
        "ours_vs_torch_fused": round(ms["torch_fused_adamw"] / ms["ours_adam"], 3),
        "ours_with_bf16_copy_vs_torch_fused_then_copy": round(
            ms["torch_fused_adamw_then_bf16_copy"] / ms["ours_adam_bf16_copy"], 3
        ),
        "ours_gbps_over_memcpy_gbps": round((28 / ms["ours_adam"]) / (56 / ms["memcpy_d2d"]), 3),
        "bf16_copy_time_over_adam_time": round(ms["ours_adam_bf16_copy"] / ms["ours_adam"], 3),
        "cast_flatten_vs_copy_per_tensor": round(
            ms["torch_copy_per_tensor_400"] / ms["cast_flatten_400_fp32_to_bf16"], 3
        ),
    }
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    good = (
        summary["vs_interpreter"]["mismatching_elements"] == 0
        and summary["vs_torch_fused"]["ok"]
        and summary["cast_flatten"]["mismatching_bytes"] == 0
        and summary["torch_sqrt_parity"]["mismatching_elements"] == 0
    )
    summary["correct"] = good
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    print(markdown(summary))
    if a.json is not None:
        a.json.write_text(text + "\n")
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
