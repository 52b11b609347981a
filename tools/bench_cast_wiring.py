"""Micro-benchmark: the runtime's cast + copy sites, torch ops against ``kernels.cast_flatten``.

Each site is timed as it runs today and as it would with the kernel, interleaved in one process
(``--rounds`` rounds, each variant once per round, medians), at 1 and 2 torch threads:

* ``export``: an export with ``--dtype bf16`` casts a batch of fp32 tensors read from a checkpoint
  (``ucp/conversion/exporters/stream.py``): a ``.to(bf16)`` per tensor (fresh memory each), against one
  ``cast_flatten`` of the batch into a buffer allocated per batch, and into one buffer reused batch
  after batch (what ``stream.CastArena`` does).
* ``stage3``: a ZeRO-3 gradient (bf16) laid into the fp32 reduce-scatter input
  (``training/zero/optimizer.py``): ``torch.zeros`` then ``copy_`` (two passes over the head), against
  ``torch.empty`` + ``copy_`` + zeroing only the padded tail (wired), and the same with ``cast_flatten``.
* ``stage2``: a bf16 gradient slice copied into a ZeRO-2 fp32 bucket: ``copy_`` against ``cast_flatten``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import kernels


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _run(variants: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    """Median seconds per call of each variant, interleaved round by round (one warm-up call first)."""
    for fn in variants.values():
        fn()
    got: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            got[k].append(sum(_time(fn) for _ in range(reps)) / reps)
    return {k: statistics.median(v) for k, v in got.items()}


def export_site(total: int) -> dict[str, Callable[[], object]]:
    shapes = [(4096, 1024), (1024,), (4096, 4096), (11008, 1024), (1024, 11008)] * 4
    scale = total / sum(torch.Size(s).numel() for s in shapes)
    shapes = [tuple(max(1, int(d * scale**0.5)) if len(s) == 2 else d for d in s) for s in shapes]
    values = [torch.randn(s) for s in shapes]
    n = sum(v.numel() for v in values)

    def before() -> None:
        out = [v.to(torch.bfloat16) for v in values]
        del out

    def after() -> None:
        arena = torch.empty(n, dtype=torch.bfloat16)
        kernels.cast_flatten(values, arena)
        del arena

    kept = torch.empty(n, dtype=torch.bfloat16)

    def reused() -> None:
        kernels.cast_flatten(values, kept)

    return {
        "export: .to(bf16) per tensor (before)": before,
        "export: cast_flatten into a batch buffer": after,
        "export: cast_flatten into a reused buffer (wired)": reused,
    }


def stage3_site(numel: int, parts: int = 2) -> dict[str, Callable[[], object]]:
    flat = torch.randn(numel).to(torch.bfloat16)
    psize = -(-numel // parts) + 3  # some padding past the gradient

    def before() -> None:
        inp = torch.zeros(psize * parts, dtype=torch.float32)
        inp[:numel].copy_(flat)

    def copy_tail() -> None:
        inp = torch.empty(psize * parts, dtype=torch.float32)
        inp[:numel].copy_(flat)
        inp[numel:].zero_()

    def kernel() -> None:
        inp = torch.empty(psize * parts, dtype=torch.float32)
        kernels.cast_flatten([flat], inp)
        inp[numel:].zero_()

    return {
        f"stage3 {numel}: zeros + copy_ (before)": before,
        f"stage3 {numel}: empty + copy_ + zero tail (wired)": copy_tail,
        f"stage3 {numel}: empty + cast_flatten + zero tail": kernel,
    }


def stage2_site(numel: int) -> dict[str, Callable[[], object]]:
    flat = torch.randn(numel).to(torch.bfloat16)
    bucket = torch.zeros(numel + 64, dtype=torch.float32)
    dst = bucket[32 : 32 + numel]
    return {
        f"stage2 {numel}: copy_ (before)": lambda: dst.copy_(flat),
        f"stage2 {numel}: cast_flatten": lambda: kernels.cast_flatten([flat], dst),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--export-elements", type=int, default=40_000_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    print(f"backend: {kernels.backend()}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        sites = [
            (export_site(args.export_elements), 1),
            (stage3_site(4_000_000), 3),
            (stage3_site(65_536), 50),
            (stage2_site(4_000_000), 3),
            (stage2_site(65_536), 50),
        ]
        print(f"\n{threads} thread(s): median ms per call ({args.rounds} interleaved rounds)")
        for variants, reps in sites:
            res = _run(variants, args.rounds, reps)
            base = next(iter(res.values()))
            for k, v in res.items():
                print(f"  {k:<60} {v * 1e3:9.3f} ms  {base / v:5.2f}x")


if __name__ == "__main__":
    main()
