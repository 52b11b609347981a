#!/usr/bin/env python
"""Benchmark kernels.adam and kernels.copy_crc32c against their peers; print a markdown table.

    .venv/bin/python tools/bench_kernels.py                       # 100M parameters, 1 and 2 threads
    .venv/bin/python tools/bench_kernels.py --params 10000000 --rounds 5 --no-deepspeed

One Adam step over flat fp32 buffers (param, grad, exp_avg, exp_avg_sq: 28 B/param read or written;
+2 B/param for a bf16 copy-back): ours, ours + bf16 copy-back, ours in torch_sqrt (bit-equal) mode,
the op-by-op torch update the runtime used before,
``torch.optim.AdamW(fused=True)``, ``AdamW(foreach=True)``, DeepSpeed's ``DeepSpeedCPUAdam`` when it
imports and its ``cpu_adam`` op builds (``TORCH_EXTENSIONS_DIR`` defaults to a cache beside the
kernels'), with and without a bf16 copy-back (DeepSpeed casts in a separate pass), and a memory-copy
baseline: a torch copy moving the same 28 B/param. Then copy + CRC-32C of ``--crc-mib`` against a
plain copy. Implementations run interleaved, one call each per round, after a warm-up call; the
table shows medians. Progress goes to stderr, the markdown to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import kernels  # noqa: E402
from kernels._build import cache_dir  # noqa: E402
from ucp.bench.report import cpu_model, source_commit  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _deepspeed(param: torch.nn.Parameter) -> tuple[Callable[[], None] | None, str]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found,unused-ignore]

        opt = DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        return opt.step, "DeepSpeedCPUAdam"
    except Exception as e:  # not installed, or its op does not build here
        return None, f"DeepSpeedCPUAdam skipped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _python() -> str:
    exe = Path(sys.executable)
    return str(exe.relative_to(REPO)) if exe.is_relative_to(REPO) else exe.name


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def bench_adam(n: int, threads: int, rounds: int, deepspeed: bool, notes: list[str]) -> dict[str, float]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    param = torch.nn.Parameter(p)  # shares p's storage: every implementation updates the same weights
    param.grad = g
    fused = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    foreach = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)
    src, dst = torch.empty(n * 14, dtype=torch.uint8), torch.empty(n * 14, dtype=torch.uint8)
    src.fill_(1)
    step = [0]

    def ours(out_: torch.Tensor | None = None, torch_sqrt: bool = False) -> None:
        step[0] += 1
        kernels.adam(p, g, m, v, step=step[0], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                     out=out_, torch_sqrt=torch_sqrt)  # fmt: skip

    def copy() -> None:
        dst.copy_(src)

    def ref() -> None:
        step[0] += 1
        kernels.adam_reference(p, g, m, v, step=step[0], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                               weight_decay=WD)  # fmt: skip

    src_np, dst_np = src.numpy(), dst.numpy()
    impls: dict[str, Callable[[], None]] = {
        "memory copy, 28 B/param (torch copy_)": copy,
        "memory copy, 28 B/param (numpy copyto: libc memcpy, 1 thread)": lambda: np.copyto(dst_np, src_np),
        "kernels.adam": lambda: ours(),
        "kernels.adam + bf16 copy-back": lambda: ours(out),
        "kernels.adam, torch_sqrt (bit-equal mode)": lambda: ours(None, True),
        "op by op (kernels.adam_reference; training/adam.py before)": lambda: ref(),
        "torch AdamW(fused=True)": fused.step,
        "torch AdamW(foreach=True)": foreach.step,
    }
    if deepspeed:
        ds_step, why = _deepspeed(param)
        if ds_step is None:
            if why not in notes:
                notes.append(why)
        else:
            impls["DeepSpeedCPUAdam"] = ds_step

            def ds_copy() -> None:
                ds_step()
                out.copy_(p)

            impls["DeepSpeedCPUAdam + bf16 copy-back"] = ds_copy
    times: dict[str, list[float]] = {k: [] for k in impls}
    for name, fn in impls.items():  # warm-up: first touch of the pages, optimizer state allocation
        print(f"[{threads} thread(s)] warm-up {name}", file=sys.stderr, flush=True)
        fn()
    for r in range(rounds):
        for name, fn in impls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        print(f"[{threads} thread(s)] round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {k: _median_ms(t) for k, t in times.items()}


def bench_crc(nbytes: int, threads: int, rounds: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    arr, out = src.numpy(), dst.numpy()
    impls: dict[str, Callable[[], object]] = {
        "memory copy (torch copy_)": lambda: dst.copy_(src),
        "memory copy (numpy copyto: libc memcpy, 1 thread)": lambda: np.copyto(out, arr),
        "kernels.copy_crc32c": lambda: kernels.copy_crc32c(dst, src),
        "copy, then crc32c.crc32c (two passes)": lambda: (dst.copy_(src), crc32c.crc32c(arr.data)),
    }
    return _interleave(impls, rounds)


def _model_like(total: int, gen: torch.Generator) -> list[torch.Tensor]:
    """fp32 tensors shaped like a transformer's: per layer 4 square and 2 4x-wide matrices, norms, biases."""
    d = 1024
    tensors: list[torch.Tensor] = []
    while sum(t.numel() for t in tensors) < total:
        tensors += [torch.randn(d, d, generator=gen) for _ in range(4)]
        tensors += [torch.randn(4 * d, d, generator=gen), torch.randn(d, 4 * d, generator=gen)]
        tensors += [torch.randn(d, generator=gen), torch.randn(d, generator=gen), torch.randn(4 * d, generator=gen)]
    return tensors


def bench_cast(total: int, threads: int, rounds: int) -> tuple[dict[str, float], int, int]:
    torch.set_num_threads(threads)
    tensors = _model_like(total, torch.Generator().manual_seed(1))
    n = sum(t.numel() for t in tensors)
    out = torch.empty(n, dtype=torch.bfloat16)

    def slots() -> None:
        at = 0
        for t in tensors:
            out[at : at + t.numel()].view(t.shape).copy_(t)
            at += t.numel()

    def slots_crc() -> None:
        slots()
        at = 0
        raw = out.view(torch.uint8).numpy()
        for t in tensors:
            crc32c.crc32c(raw[2 * at : 2 * (at + t.numel())].data)
            at += t.numel()

    impls: dict[str, Callable[[], object]] = {
        "torch.cat([t.to(bf16).flatten() ...])": lambda: torch.cat([t.to(torch.bfloat16).flatten() for t in tensors]),
        "torch copy_ into each slot of the buffer": slots,
        "kernels.cast_flatten": lambda: kernels.cast_flatten(tensors, out),
        "torch copy_ into slots, then crc32c.crc32c per tensor": slots_crc,
        "kernels.cast_flatten(crc=True)": lambda: kernels.cast_flatten(tensors, out, crc=True),
    }
    return _interleave(impls, rounds), n, len(tensors)


def _interleave(impls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """One warm-up call each, then `rounds` rounds calling each implementation once; medians in ms."""
    times: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():
        fn()
    for _ in range(rounds):
        for name, fn in impls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: _median_ms(t) for k, t in times.items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--crc-mib", type=int, default=400)
    ap.add_argument("--cast-params", type=int, default=50_000_000, help="fp32 elements cast to bf16")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    n = args.params
    notes: list[str] = []
    adam = {t: bench_adam(n, t, args.rounds, not args.no_deepspeed, notes) for t in threads}
    crc = {t: bench_crc(args.crc_mib << 20, t, args.rounds) for t in threads}
    cast = {t: bench_cast(args.cast_params, t, args.rounds) for t in threads}

    print(f"Fused CPU kernels — {datetime.date.today().isoformat()}, commit {source_commit(REPO)}, {cpu_model()}, "
          f"torch {torch.__version__}, backend `{kernels.backend()}`")  # fmt: skip
    print()
    print(f"Command: `{' '.join([_python(), 'tools/bench_kernels.py', *argv])}` "
          f"(medians of {args.rounds} interleaved rounds after a warm-up; load before: {os.getloadavg()[0]:.2f})")  # fmt: skip
    print()
    print(f"One Adam(W) step, {n / 1e6:g}M fp32 parameters (28 B/param of state touched; 30 with bf16 copy-back):")
    print()
    head = " | ".join(f"{t} thread{'s' if t > 1 else ''}: ms | GB/s | × fused" for t in threads)
    print(f"| implementation | {head} |")
    print("|---|" + "---|---|---|" * len(threads))
    for name in adam[threads[0]]:
        cells = []
        for t in threads:
            ms = adam[t].get(name)
            if ms is None:
                cells.append("– | – | –")
                continue
            per = 30 if "bf16" in name else 28
            gbs = n * per / (ms / 1e3) / 1e9
            rel = adam[t]["torch AdamW(fused=True)"] / ms
            cells.append(f"{ms:.1f} | {gbs:.1f} | {rel:.2f}")
        print(f"| {name} | {' | '.join(cells)} |")
    print()
    for t in threads:
        a = adam[t]
        copy_ms = min(v for k, v in a.items() if k.startswith("memory copy"))
        line = (
            f"- {t} thread(s): kernels.adam {a['torch AdamW(fused=True)'] / a['kernels.adam']:.2f}× torch fused; "
            f"copy-back costs {a['kernels.adam + bf16 copy-back'] / a['kernels.adam']:.2f}× kernels.adam alone; "
            f"kernels.adam moves state at {copy_ms / a['kernels.adam']:.2f}× the faster memory copy's rate"
        )
        if "DeepSpeedCPUAdam" in a:
            line += (
                f"; {a['DeepSpeedCPUAdam'] / a['kernels.adam']:.2f}× DeepSpeedCPUAdam "
                f"(its copy-back: {a['DeepSpeedCPUAdam + bf16 copy-back'] / a['DeepSpeedCPUAdam']:.2f}×)"
            )
        print(line)
    for note in notes:
        print(f"- {note}")
    print()
    nbytes = args.crc_mib << 20
    print(f"Copy + CRC-32C of {args.crc_mib} MiB (× copy: against the faster plain copy at that thread count):")
    print()
    head = " | ".join(f"{t} thread{'s' if t > 1 else ''}: ms | GB/s copied | × copy" for t in threads)
    print(f"| implementation | {head} |")
    print("|---|" + "---|---|---|" * len(threads))
    for name in crc[threads[0]]:
        cells = []
        for t in threads:
            ms = crc[t][name]
            best = min(v for k, v in crc[t].items() if k.startswith("memory copy"))
            cells.append(f"{ms:.1f} | {nbytes / (ms / 1e3) / 1e9:.1f} | {best / ms:.2f}")
        print(f"| {name} | {' | '.join(cells)} |")
    print()
    _, cn, ct = cast[threads[0]]
    print(f"Cast + flatten of {ct} fp32 tensors ({cn / 1e6:.1f}M elements, shaped like a transformer's) into one "
          f"bf16 buffer (6 B/element moved; × cat: against torch.cat of the casts):")  # fmt: skip
    print()
    head = " | ".join(f"{t} thread{'s' if t > 1 else ''}: ms | GB/s | × cat" for t in threads)
    print(f"| implementation | {head} |")
    print("|---|" + "---|---|---|" * len(threads))
    for name in cast[threads[0]][0]:
        cells = []
        for t in threads:
            res = cast[t][0]
            ms = res[name]
            cat_ms = res["torch.cat([t.to(bf16).flatten() ...])"]
            cells.append(f"{ms:.1f} | {cn * 6 / (ms / 1e3) / 1e9:.1f} | {cat_ms / ms:.2f}")
        print(f"| {name} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
