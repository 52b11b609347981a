"""DeepSpeed ZeRO with optimizer offload, stepped on demand: the DeepSpeed method of tools/bench_offload.py.

Why: issue 17's benchmark compares our offload tiers with DeepSpeed's own engine on the same model, seed,
data and ``zero_optimization`` offload keys, one step at a time, interleaved with our methods, each in its
own process. This script is that process: one rank (CPU accelerator, gloo), DeepSpeed's ``cpu_adam``
(DeepSpeedCPUAdam, AdamW mode) and, for ``offload_optimizer.device: nvme``, its ``async_io`` swapper, both
JIT-built by DeepSpeed on first use (ninja, a C++ compiler and libaio-dev). Not used by tests or CI.

    DS_ACCELERATOR=cpu PYTHONPATH=. .venv/bin/python tools/peers/deepspeed_offload.py --model small \\
        --zero-stage 3 --zero-config '{"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}'

then one JSON line per turn on stdin (``{"steps": [0, 1]}``), answers on stdout (tools/bench_offload.py's
``serve``). The swap files go to a fresh directory made inside ``nvme_path``, removed at exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from training.models import PRESETS

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234, help="model init and data seed")
    p.add_argument("--zero-config", required=True, help="zero_optimization section as JSON (offload keys)")
    return p.parse_args(argv)


def ds_config(args: argparse.Namespace, zero: dict[str, Any]) -> dict[str, Any]:
    """tools/peers/deepspeed_train.py's run (AdamW, lr 1e-3, betas (0.9, 0.95), weight decay 0.01, no clipping),
    with DeepSpeed's own CPU Adam when the optimizer is offloaded (``torch_adam`` off)."""
    from tools.peers.deepspeed_train import deepspeed_config

    ns = argparse.Namespace(
        micro_batch=args.micro_batch, grad_accum=1, lr=1e-3, weight_decay=0.01, zero_stage=args.zero_stage,
        dtype=args.dtype, grad_clip=0.0, ds_config_extra=json.dumps({"zero_optimization": zero}),
    )  # fmt: skip
    cfg: dict[str, Any] = deepspeed_config(ns)
    if zero.get("offload_optimizer", {}).get("device", "none") != "none":
        cfg["optimizer"]["params"].pop("torch_adam")
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tools.bench_offload import protocol_stream, serve

    out = protocol_stream()  # DeepSpeed logs to stdout
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    os.environ.setdefault("MASTER_PORT", str(port))
    import deepspeed
    import torch

    from tools.peers.deepspeed_train import skip_shm_op
    from training.models import GPT, PRESETS, batch_for_step

    skip_shm_op()
    zero = json.loads(args.zero_config)
    swap_dirs: list[Path] = []
    for section in ("offload_optimizer", "offload_param"):
        tier = zero.get(section, {})
        if tier.get("device") == "nvme":  # a fresh directory of this run's own, removed at exit
            swap_dirs.append(Path(tempfile.mkdtemp(prefix="ucp-bench-deepspeed-swap-", dir=tier["nvme_path"])))
            tier["nvme_path"] = str(swap_dirs[-1])
    try:
        torch.manual_seed(args.seed)
        deepspeed.init_distributed(dist_backend="gloo")
        cfg = PRESETS[args.model]
        model = GPT(cfg, seed=args.seed)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(args, zero)
        )

        def step(s: int) -> float:
            tokens, targets = batch_for_step(
                s, args.micro_batch, args.seq, cfg.vocab_size, args.seed, rank=0, world_size=1
            )
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            return float(loss.detach().float())

        state = 12 * sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        ready = {
            "deepspeed": deepspeed.__version__,
            "state_bytes_computed": state,
            "optimizer": type(engine.optimizer).__name__,
        }
        serve(step, lambda: None, lambda: None, ready, out=out)
    finally:
        for swap_dir in swap_dirs:
            shutil.rmtree(swap_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no process-group teardown (see deepspeed_train.py)
