"""Train the reference GPT with DeepSpeed ZeRO on CPU and save a real DeepSpeed checkpoint.

Why: UCP's importer tests, reshard benchmarks and training-parity tests need checkpoints and loss
curves written by DeepSpeed itself, not by a re-implementation of its format.

Run under torchrun (one process per data-parallel rank, gloo, CPU accelerator):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=/work/main \
    torchrun --standalone --nproc-per-node=2 tools/peers/deepspeed_train.py \
        --out-dir /tmp/ds --zero-stage 2 --dtype fp32 --steps 3 --loss-file /tmp/ds/loss.json

`--steps` is the global step to train *until*: with `--load-dir` the run resumes at the step the
checkpoint was saved at and stops at `--steps`, so (0 -> 5) and (0 -> 3, resume 3 -> 5) see the
same data. Step s uses `training.models.batch_for_step(s, ...)`; the global batch of a step is
`micro_batch * world_size * grad_accum` rows and is split over ranks as documented there.

Flags avoid prefixes of torchrun's own options (e.g. no `--log`, no `--d`), and abbreviations are
refused, so a typo cannot silently select another option.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from training.models import GPT, PRESETS, GPTConfig, batch_for_step

# Bumped when anything changes the bytes this script writes for the same arguments (cache key).
HARNESS_VERSION = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out-dir", type=Path, help="save_checkpoint() directory (omit to skip saving)")
    p.add_argument("--load-dir", type=Path, help="resume from this DeepSpeed checkpoint directory")
    p.add_argument("--load-tag", help="tag to resume from (default: the `latest` file)")
    p.add_argument("--tag", help="checkpoint tag to save under (default: global_step<N>)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--steps", type=int, required=True, help="train until this global step")
    p.add_argument("--loss-file", type=Path, help="JSON file for per-step losses (rank 0 writes)")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="preset config name")
    p.add_argument("--model-json", help="GPTConfig as JSON text (overrides --model)")
    p.add_argument("--seed", type=int, default=1234, help="model init seed")
    p.add_argument("--data-seed", type=int, help="synthetic data seed (default: --seed)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=0.0, help="0 disables clipping")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq", type=int, help="sequence length (default: the model's max_seq)")
    p.add_argument(
        "--with-shm-op", action="store_true", help="let DeepSpeed JIT-build its shared-memory comm op (see skip_shm_op)"
    )
    p.add_argument(
        "--ds-config-extra",
        default="{}",
        help="JSON merged into the DeepSpeed config (zero_optimization merged key-wise)",
    )
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> GPTConfig:
    if args.model_json:
        return GPTConfig.model_validate_json(args.model_json)
    return PRESETS[args.model]


def deepspeed_config(args: argparse.Namespace) -> dict:
    """The DeepSpeed config: torch.optim.AdamW (no compiled ops), constant LR, chosen ZeRO stage."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": args.lr,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": args.weight_decay,
                "torch_adam": True,
            },
        },
        "zero_optimization": {"stage": args.zero_stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "gradient_clipping": args.grad_clip,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    extra = json.loads(args.ds_config_extra)
    zero_extra = extra.pop("zero_optimization", {})
    cfg.update(extra)
    cfg["zero_optimization"].update(zero_extra)
    return cfg


def skip_shm_op() -> None:
    """Stop DeepSpeed's CPU backend from JIT-compiling `deepspeed_shm_comm` at init_distributed.

    That op serves only `inference_all_reduce`; training collectives go through
    torch.distributed (gloo) either way, so checkpoints and losses are unaffected. Building it
    needs a C++ compiler and costs ~90 s on 2 cores the first time on every fresh machine.
    """
    import importlib

    # `import deepspeed.comm.torch as m` would bind the real torch: deepspeed.comm has a `torch`
    # attribute of its own. Fetch the submodule by its full name instead.
    backend: Any = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # after DS_ACCELERATOR is set
    import torch.distributed as dist

    if not args.with_shm_op:
        skip_shm_op()
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args)
    seq = args.seq or cfg.max_seq
    data_seed = args.seed if args.data_seed is None else args.data_seed

    model = GPT(cfg, seed=args.seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(args)
    )
    start = 0
    if args.load_dir is not None:
        path, _client = engine.load_checkpoint(str(args.load_dir), tag=args.load_tag)
        if path is None:
            raise SystemExit(f"deepspeed_train: no checkpoint loaded from {args.load_dir}")
        start = engine.global_steps
    t_init = time.perf_counter()

    losses: list[dict] = []
    for step in range(start, args.steps):
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(args.grad_accum):
            tokens, targets = batch_for_step(
                step,
                args.micro_batch,
                seq,
                cfg.vocab_size,
                data_seed,
                rank=rank,
                world_size=world,
                micro_step=micro,
                grad_accum=args.grad_accum,
            )
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        dist.all_reduce(total)  # sum over ranks and micro-steps -> mean of the global batch
        losses.append({"step": step, "loss": float(total) / (world * args.grad_accum)})
    t_train = time.perf_counter()

    saved_tag = None
    if args.out_dir is not None:
        tag = args.tag or f"global_step{engine.global_steps}"
        engine.save_checkpoint(
            str(args.out_dir), tag=tag, client_state={"data_seed": data_seed, "harness_version": HARNESS_VERSION}
        )
        saved_tag = tag
    dist.barrier()
    t_save = time.perf_counter()

    if rank == 0 and args.loss_file is not None:
        record = {
            "harness_version": HARNESS_VERSION,
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "world_size": world,
            "zero_stage": args.zero_stage,
            "dtype": args.dtype,
            "seed": args.seed,
            "data_seed": data_seed,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "grad_clip": args.grad_clip,
            "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum,
            "seq": seq,
            "model": cfg.model_dump(),
            "num_params": cfg.num_params(),
            "start_step": start,
            "end_step": engine.global_steps,
            "losses": losses,
            "tag": saved_tag,
            "seconds": {"init": t_init - t0, "train": t_train - t_init, "save": t_save - t_train},
        }
        args.loss_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.loss_file.with_name(args.loss_file.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(args.loss_file)
    dist.barrier()
    return 0


if __name__ == "__main__":
    rc = main()
    # Leave without interpreter/process-group teardown: once in ~10 ZeRO-3 bf16 runs a rank
    # aborted there ("terminate called without an active exception") after everything was saved.
    # The checkpoint and loss file are complete (two barriers above); the OS closes the sockets.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
