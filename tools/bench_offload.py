#!/usr/bin/env python
"""Step time of the training engine with the optimizer state in memory, on the CPU tier and on the NVMe tier.

    .venv/bin/python tools/bench_offload.py --nvme-path /tmp                          # the "small" GPT
    .venv/bin/python tools/bench_offload.py --model gpt-100m --nvme-path /data --swap-budget 1GiB --steps 5

Methods, one engine each, built once, on the same model and data: ``memory`` (no offload), ``cpu``
(offload_optimizer cpu), ``nvme`` (offload_optimizer nvme, pipelined) and ``nvme-serial``
(pipeline_read and pipeline_write off). After a warm-up step each, the methods take turns, one
training step each per round (interleaved, in a rotating order), and the table shows medians: whole
step, the optimizer's part on the offload tiers (its read wait, Adam, write wait), the time the I/O
threads were busy and the share of it hidden behind other work (1 - waits / busy), the bytes read and
written per step and the swap rate (bytes moved / optimizer seconds). The losses of every method must
agree bit for bit (they are checked). Progress goes to stderr, the markdown to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from aio.sizes import SIZE_HELP, format_size, parse_size  # noqa: E402
from training import Engine  # noqa: E402
from training.models.gpt import PRESETS  # noqa: E402
from training.offload import OffloadConfig  # noqa: E402

METHODS = ("memory", "cpu", "nvme", "nvme-serial")


def offload_for(method: str, args: argparse.Namespace) -> OffloadConfig:
    if method == "memory":
        return OffloadConfig()
    optimizer: dict[str, Any] = {"device": "cpu" if method == "cpu" else "nvme"}
    if method != "cpu":
        optimizer["nvme_path"] = args.nvme_path
    if method == "nvme-serial":
        optimizer |= {"pipeline_read": False, "pipeline_write": False}
    return OffloadConfig.model_validate(
        {"offload_optimizer": optimizer, "sub_group_size": args.sub_group_size, "swap_budget": args.swap_budget}
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="measured rounds (one step per method each)")
    p.add_argument("--nvme-path", required=True, help="directory for the NVMe tier (a fresh one is made inside)")
    p.add_argument("--sub-group-size", type=int, default=2_000_000, help="elements per sub-group")
    p.add_argument("--swap-budget", default="256MiB", help=f"the NVMe tier's pool budget ({SIZE_HELP})")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    args = p.parse_args(argv)
    args.swap_budget = parse_size(args.swap_budget, what="--swap-budget")
    methods = [m for m in args.methods.split(",") if m]
    if bad := [m for m in methods if m not in METHODS]:
        p.error(f"unknown method(s) {bad}; choose from {METHODS}")
    load = os.getloadavg()[0]
    options = {
        "zero_stage": args.zero,
        "dtype": args.precision,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
    }
    engines = {}
    for m in methods:
        print(f"building {m} ...", file=sys.stderr, flush=True)
        engines[m] = Engine(args.model, offload=offload_for(m, args), **options)
    times: dict[str, list[float]] = {m: [] for m in methods}
    parts: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    losses: dict[str, list[float]] = {m: [] for m in methods}
    try:
        for step in range(args.steps + 1):  # step 0: warm-up, not counted
            order = methods[step % len(methods) :] + methods[: step % len(methods)]
            for m in order:
                t0 = time.perf_counter()
                losses[m].append(engines[m].train_step(step))
                dt = time.perf_counter() - t0
                off = engines[m].optimizer.offload
                if step:
                    times[m].append(dt)
                    if off is not None:
                        parts[m].append(dict(off.last))
            print(
                f"step {step}: " + ", ".join(f"{m} {times[m][-1] if step else 0:.3f}s" for m in methods),
                file=sys.stderr,
            )
        tiers = {m: e.optimizer.offload.describe() for m, e in engines.items() if e.optimizer.offload is not None}
        state = 12 * sum(pl.size for pl in engines[methods[0]].optimizer.plans)
    finally:
        for e in engines.values():
            e.close()
    agree = all(losses[m] == losses[methods[0]] for m in methods)
    med = statistics.median
    base = med(times["memory"]) if "memory" in times else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"Measured at commit {_commit()}, recorded {date}, {_cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    )
    print()
    print(
        f"Command: `.venv/bin/python tools/bench_offload.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"(medians of {args.steps} interleaved steps after a warm-up; load before: {load:.2f})"
    )
    print()
    print(
        f"Model `{args.model}`, ZeRO-{args.zero}, {args.precision}, fp32 master + moments {format_size(state)}; "
        f"sub_group_size {args.sub_group_size}, swap_budget {format_size(args.swap_budget)}; losses bit-equal "
        f"across methods: {'yes' if agree else 'NO'}; peak RSS of the process (all engines) {format_size(rss)}"
    )
    print()
    print(
        "| method | step s | × memory | optimizer s | read wait s | Adam s | write wait s | I/O busy s | hidden | read MB/step | written MB/step | swap GB/s | pool |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in methods:
        step_s = med(times[m])
        ratio = f"{step_s / base:.2f}" if base else "–"
        if parts[m]:
            f = {k: med(x[k] for x in parts[m]) for k in parts[m][0]}
            moved = f["bytes_read"] + f["bytes_written"]
            rate = f"{moved / f['seconds'] / 1e9:.2f}" if moved else "–"
            busy = f["io_read"] + f["io_write"]
            hidden = f"{max(0.0, 1 - (f['read_wait'] + f['write_wait']) / busy):.0%}" if busy else "–"
            tier = tiers[m]
            pool = (
                format_size(tier["pool_bytes"])
                if "pool_bytes" in tier
                else f"resident {format_size(tier['resident_bytes'])}"
            )
            print(
                f"| {m} | {step_s:.3f} | {ratio} | {f['seconds']:.3f} | {f['read_wait']:.3f} | {f['compute']:.3f} | "
                f"{f['write_wait']:.3f} | {busy:.3f} | {hidden} | {f['bytes_read'] / 1e6:.0f} | "
                f"{f['bytes_written'] / 1e6:.0f} | {rate} | {pool} |"
            )
        else:
            print(f"| {m} | {step_s:.3f} | {ratio} | – | – | – | – | – | – | 0 | 0 | – | – |")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
