#!/usr/bin/env python
"""Training step time of the reference GPT on 2 gloo ranks: the op-by-op Adam against kernels.adam, in one run.

    .venv/bin/python tools/bench_train_step.py                                  # small, ZeRO-1 and ZeRO-3
    .venv/bin/python tools/bench_train_step.py --model gpt-100m --seq-len 128 --steps 6 --rounds 2

Variants (each a fresh launch of ``--procs`` ranks, ``training.Engine`` with dp = procs):

* ``op-by-op``: ``UCP_KERNELS=torch``: kernels.adam's pure-torch path, torch.optim's single-tensor
  update op by op (about eight passes over the optimizer state), what the runtime ran before;
* ``fused, torch_sqrt``: the C++ kernel in its bit-equal mode (torch's MKL sqrt per block);
* ``fused, IEEE sqrt``: the C++ kernel in its fast mode (``EngineConfig.adam_torch_sqrt=False``).

Variants and ZeRO stages are interleaved over ``--rounds`` rounds. Each launch runs ``--warmup``
untimed steps, then ``--steps`` timed ones; reported per variant: the median step time on rank 0
(``train_step``: forward, backward, reduction, update, gather) and the median time of the Adam
update calls inside it (``training.zero.optimizer.adam_update``, summed per step). Progress goes to
stderr, the markdown to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VARIANTS: dict[str, dict[str, str]] = {
    "op-by-op (UCP_KERNELS=torch)": {"UCP_KERNELS": "torch", "BENCH_TORCH_SQRT": "1"},
    "fused, torch_sqrt (bit-equal)": {"UCP_KERNELS": "cpp", "BENCH_TORCH_SQRT": "1"},
    "fused, IEEE sqrt (fast)": {"UCP_KERNELS": "cpp", "BENCH_TORCH_SQRT": "0"},
}


def run_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns its step and update times."""
    import torch
    import torch.distributed as dist

    import training.zero.optimizer as zopt
    from training import Engine
    from training.models.gpt import expected_param_shapes

    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    engine = Engine(
        args.model,
        mesh={"tp": 1, "pp": 1, "dp": world},
        zero_stage=int(os.environ["BENCH_ZERO"]),
        dtype=args.precision,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        lr=1e-4,
        weight_decay=0.01,
        adam_torch_sqrt=os.environ["BENCH_TORCH_SQRT"] == "1",
    )
    spent = [0.0]
    real = zopt.adam_update

    def timed_update(*a: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        real(*a, **kw)
        spent[0] += time.perf_counter() - t0

    zopt.adam_update = timed_update
    steps, updates = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        spent[0] = 0.0
        t0 = time.perf_counter()
        engine.train_step(step)
        if step >= args.warmup:
            steps.append(time.perf_counter() - t0)
            updates.append(spent[0])
    import kernels

    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank:
        return None
    return {
        "step": statistics.median(steps),
        "update": statistics.median(updates),
        "params": sum(math.prod(s) for s in expected_param_shapes(engine.cfg.model).values()),
        "kernels": kernels.backend(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace, argv: list[str], zero: int, variant: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as d:
        result = Path(d) / "rank0.json"
        env = {
            **os.environ,
            **variant,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(args.procs),
            "GLOO_SOCKET_IFNAME": "lo",
            "BENCH_ZERO": str(zero),
            "BENCH_RESULT": str(result),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        procs = [
            subprocess.Popen([sys.executable, __file__, *argv, "--worker"], env={**env, "RANK": str(r)})
            for r in range(args.procs)
        ]
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise SystemExit(f"bench_train_step: ranks exited with {codes}")
        return dict(json.loads(result.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="a preset of training.models.gpt.PRESETS")
    ap.add_argument("--zero", type=int, nargs="+", default=[1, 3], choices=(1, 2, 3))
    ap.add_argument("--procs", type=int, default=2, help="gloo ranks (dp)")
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores / ranks)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        out = run_rank(args)
        if out is not None:
            Path(os.environ["BENCH_RESULT"]).write_text(json.dumps(out))
        return
    argv = sys.argv[1:]
    res: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for zero in args.zero:
            for name, variant in VARIANTS.items():
                out = launch(args, argv, zero, variant)
                res.setdefault((zero, name), []).append(out)
                print(f"round {r + 1} zero {zero} {name}: {json.dumps(out)}", file=sys.stderr)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    first = next(iter(res.values()))[0]
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {sha.stdout.strip()}, "
        f"model {args.model} ({first['params'] / 1e6:.1f}M parameters), {args.precision}, {args.procs} gloo ranks, "
        f"micro-batch {args.micro_batch}, seq-len {args.seq_len or 'model max'}, {args.steps} steps x {args.rounds} rounds, medians\n"
    )
    print("| ZeRO | Adam | step ms | vs op-by-op | Adam update ms per step |")
    print("|---|---|---|---|---|")
    for zero in args.zero:
        base = statistics.median(x["step"] for x in res[(zero, next(iter(VARIANTS)))])
        for name in VARIANTS:
            step = statistics.median(x["step"] for x in res[(zero, name)])
            upd = statistics.median(x["update"] for x in res[(zero, name)])
            print(f"| {zero} | {name} | {step * 1e3:.1f} | {step / base - 1:+.1%} | {upd * 1e3:.1f} |")


if __name__ == "__main__":
    main()
