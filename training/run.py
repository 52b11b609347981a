"""Train the reference GPT from the command line; one JSON line per step on rank 0.

    python -m training.run --steps 20 --model tiny                          # one process
    torchrun --nproc-per-node 4 -m training.run --steps 20 --tp 2 --dp 2 --zero 2 --precision bf16

The world size must equal tp × pp × dp (``--dp`` defaults to what is left). Output lines look like
``{"step": 3, "loss": 4.61, "grad_norm": 0.8, "skipped": false, "seconds": 0.12}``, then a final
``{"done": true, ...}`` (with rank 0's ``peak_rss``; with the optimizer offloaded, the tier's shape, and each
step's line its NVMe ``swap`` traffic). With ``--save-dir ROOT`` the run saves a checkpoint every
``--save-every`` steps (asynchronously unless ``--sync-save``; a ``{"checkpoint": step, "stall": s}``
line each) and ``--resume`` continues from the latest complete one, whatever mesh wrote it::

    torchrun --nproc-per-node 4 -m training.run --tp 2 --dp 2 --zero 2 --total-steps 20 --save-dir ck
    torchrun --nproc-per-node 2 -m training.run --dp 2 --zero 3 --total-steps 20 --save-dir ck --resume

With ``--remote s3://bucket/run`` the checkpoints are tiered: committed under ``--save-dir`` and replicated
to the object store behind; ``--node-local`` when ``--save-dir`` is each node's own disk (no shared file
system: every rank replicates its own files; asynchronous saves commit through the store), and ``--resume``
then restores from the store when the local copy is gone::

    torchrun --nnodes 2 ... -m training.run --save-dir /nvme/ck --remote s3://b/run --node-local

Optimizer state can live off memory, as DeepSpeed's ZeRO-Offload/Infinity puts it (docs/offload.md):
``--offload-optimizer cpu|nvme --nvme-path DIR [--sub-group-size N] [--swap-budget 1GiB]``, and at ZeRO-3 so
can the parameters (``--offload-param nvme``, the same ``--nvme-path``), or a DeepSpeed JSON config's
``zero_optimization`` offload keys and ``aio`` section (``--ds-config ds.json``).

Exit codes: 0 when every step ran and every checkpoint was written; 1 when a checkpoint save failed
(also an asynchronous one that failed after its ``checkpoint`` line) or training raised; 2 for bad
options, checked before anything is built. Option names avoid prefixes of torchrun's own (no
``--log...``/``--d...`` beyond ``--dp``), so they are never swallowed when placed before the script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from aio.memstat import peak_rss
from aio.sizes import SIZE_HELP


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count, a size, a period)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a step number)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None, world: int | None = None) -> argparse.Namespace:
    """The options, checked against each other and the world size (default: ``$WORLD_SIZE``, else 1)
    before anything is built: a bad combination is a usage error (exit code 2), not a traceback."""
    from training.models.gpt import PRESETS

    p = argparse.ArgumentParser(prog="python -m training.run", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--steps", type=positive_int, default=10, help="optimizer steps to run")
    p.add_argument(
        "--start-step",
        type=non_negative_int,
        default=None,
        help="number of the first step (data stream position); default 0, not with --resume",
    )
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="a preset of training.models.gpt.PRESETS")
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--pp", type=positive_int, default=1)
    p.add_argument("--dp", type=positive_int, default=None, help="default: world size / (tp × pp)")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="compute dtype")
    p.add_argument("--micro-batch", type=positive_int, default=2, help="rows per micro-batch per dp rank")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per step")
    p.add_argument("--seq-len", type=positive_int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=None, help="global gradient-norm clip")
    p.add_argument(
        "--fast-adam",
        action="store_true",
        help="kernels.adam's IEEE-sqrt mode (within a few ulp of torch.optim; default: bit-equal to it)",
    )
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--batch-seed", type=int, default=0, help="synthetic data seed")
    p.add_argument("--zero-alignment", type=positive_int, default=1)
    p.add_argument("--pad-vocab-to", type=positive_int, default=128)
    p.add_argument(
        "--total-steps",
        type=non_negative_int,
        default=None,
        help="train until this global step (instead of --steps more steps); counts from a resume",
    )
    p.add_argument("--save-dir", default=None, help="a ucp.CheckpointManager root to save checkpoints in")
    p.add_argument("--save-every", type=positive_int, default=1, help="save after every N steps (with --save-dir)")
    p.add_argument("--sync-save", action="store_true", help="save synchronously (default: asynchronously)")
    p.add_argument("--keep-last", type=positive_int, default=3, help="checkpoints kept under --save-dir")
    p.add_argument(
        "--snapshot",
        default="auto",
        choices=("auto", "cow", "background", "sync", "none"),
        help="async saves: write-protect the state and copy it from a helper process (cow; what auto "
        "picks where Linux allows it, else sync), copy it while the next step's forward/backward "
        "run (background), before save() returns (sync), or write straight from the tensors (none); "
        "with background and none the engine waits for the copy or write before its optimizer step",
    )
    p.add_argument("--resume", action="store_true", help="resume from the latest complete checkpoint of --save-dir")
    p.add_argument(
        "--remote",
        default=None,
        help="tiered checkpoints: replicate each one committed under --save-dir (node-local disk) to this "
        "object-store URL (s3://bucket/run); --resume then takes the newest step either tier holds",
    )
    p.add_argument(
        "--storage-options",
        default=None,
        help="JSON options of --remote's storage (ucp.store.s3.S3Options keys); default: the AWS variables",
    )
    p.add_argument("--remote-keep-last", type=positive_int, default=None, help="checkpoints kept under --remote")
    p.add_argument(
        "--node-local",
        action="store_true",
        help="with --remote: --save-dir is each node's own disk, not shared; every rank replicates its own "
        "files and rank 0 commits on the store",
    )
    p.add_argument(
        "--ds-config",
        default=None,
        help="a DeepSpeed JSON config: its zero_optimization offload keys and aio section are used (docs/offload.md)",
    )
    p.add_argument(
        "--offload-optimizer",
        default=None,
        choices=("none", "cpu", "nvme"),
        help="where the fp32 masters and Adam moments live between steps (overrides --ds-config's)",
    )
    p.add_argument(
        "--offload-param",
        default=None,
        choices=("none", "cpu", "nvme"),
        help="where ZeRO-3's parameter partitions live between uses (overrides --ds-config's; needs --zero 3)",
    )
    p.add_argument("--nvme-path", default=None, help="directory the nvme tiers swap to (a fresh one is made inside)")
    p.add_argument("--sub-group-size", type=positive_int, default=None, help="elements per offloaded sub-group")
    p.add_argument("--swap-budget", default=None, help=f"most bytes of the nvme tier's buffer pool ({SIZE_HELP})")
    p.add_argument(
        "--no-keep-resident",
        action="store_true",
        help="swap every optimizer sub-group (by default the budget beyond two pool slots keeps some resident)",
    )
    args = p.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    model_ranks = args.tp * args.pp
    if args.dp is None:
        if world % model_ranks:
            p.error(f"the world size {world} is not a multiple of --tp {args.tp} × --pp {args.pp} = {model_ranks}")
        args.dp = world // model_ranks
    elif model_ranks * args.dp != world:
        p.error(
            f"--tp {args.tp} × --pp {args.pp} × --dp {args.dp} = {model_ranks * args.dp} ranks, "
            f"but the world size is {world}"
        )
    if args.resume and args.save_dir is None:
        p.error("--resume needs --save-dir")
    if args.remote is not None and args.save_dir is None:
        p.error("--remote needs --save-dir (the local tier)")
    if args.node_local and args.remote is None:
        p.error("--node-local needs --remote")
    if args.storage_options is not None:
        try:
            args.storage_options = json.loads(args.storage_options)
        except ValueError as exc:
            p.error(f"--storage-options is not JSON: {exc}")
        if not isinstance(args.storage_options, dict):
            p.error("--storage-options must be a JSON object")
    if args.resume and args.start_step is not None:
        p.error("--start-step is ignored with --resume (the run continues at the checkpoint's step): give one of them")
    if args.start_step is None:
        args.start_step = 0
    try:
        args.offload = offload_config(args)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    if args.offload.zero_stage is not None and args.offload.zero_stage != args.zero:
        p.error(f"--ds-config names ZeRO stage {args.offload.zero_stage}, --zero is {args.zero}")
    if args.offload.offload_param.device != "none" and args.zero != 3:
        p.error(f"offload_param.device {args.offload.offload_param.device!r} needs --zero 3 (it is {args.zero})")
    return args


def offload_config(args: argparse.Namespace) -> Any:
    """The engine's OffloadConfig from ``--ds-config`` and the offload options (which override it)."""
    from training.offload import OffloadConfig

    base: dict[str, Any] = {}
    if args.ds_config is not None:
        with open(args.ds_config) as f:
            base = json.load(f)
    config = OffloadConfig.from_deepspeed(base)
    optimizer = config.offload_optimizer.model_dump(exclude_unset=True)
    if args.offload_optimizer is not None:
        optimizer["device"] = args.offload_optimizer
    if args.nvme_path is not None:
        optimizer["nvme_path"] = args.nvme_path
    param = config.offload_param.model_dump(exclude_unset=True)
    if args.offload_param is not None:
        param["device"] = args.offload_param
    if args.nvme_path is not None:
        param["nvme_path"] = args.nvme_path
    update: dict[str, Any] = {"offload_optimizer": optimizer, "offload_param": param}
    if args.sub_group_size is not None:
        update["sub_group_size"] = args.sub_group_size
    if args.swap_budget is not None:
        update["swap_budget"] = args.swap_budget
    if args.no_keep_resident:
        update["keep_resident"] = False
    data = {**config.model_dump(exclude_unset=True), **update}
    data["aio"] = config.aio
    return OffloadConfig.model_validate(data)


def main(argv: Sequence[str] | None = None) -> int:
    """Train as the options say; returns the exit code (1: an asynchronous checkpoint save failed)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = parse_args(argv, world)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from training.engine import Engine  # after init: building the engine creates process groups

    engine = Engine(
        args.model,
        mesh={"tp": args.tp, "pp": args.pp, "dp": args.dp},
        zero_stage=args.zero,
        dtype=args.precision,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        seq_len=args.seq_len,
        lr=args.lr,
        weight_decay=args.weight_decay,
        clip=args.clip,
        adam_torch_sqrt=not args.fast_adam,
        seed=args.seed,
        data_seed=args.batch_seed,
        zero_alignment=args.zero_alignment,
        pad_vocab_to=args.pad_vocab_to,
        device="cuda" if torch.cuda.is_available() else "cpu",
        offload=args.offload,
    )
    rank = dist.get_rank() if dist.is_initialized() else 0

    def emit(record: dict) -> None:
        if rank == 0:
            print(json.dumps(record), flush=True)

    manager = None
    first = args.start_step
    if args.save_dir is not None:
        import ucp

        manager = ucp.CheckpointManager(
            args.save_dir,
            keep_last=args.keep_last,
            async_save=not args.sync_save,
            snapshot=args.snapshot,
            remote=args.remote,
            remote_keep_last=args.remote_keep_last,
            remote_storage_options=args.storage_options,
            node_local=args.node_local,
        )
        if args.resume:
            t0 = time.perf_counter()
            first = engine.load(manager)
            emit(
                {
                    "resumed": first,
                    "from": manager.loaded_from,
                    "seconds": round(time.perf_counter() - t0, 4),
                    "mesh": engine.mesh.as_dict(),
                    "zero": args.zero,
                }
            )
        engine.prepare_checkpoints(manager)  # the first checkpoint then finds its staging ready
    last = args.total_steps if args.total_steps is not None else first + args.steps
    start = time.perf_counter()
    saved = True
    try:
        for step in range(first, last):
            t0 = time.perf_counter()
            loss = engine.train_step(step)
            stats = engine.last_stats
            norm = stats["grad_norm"]
            emit(
                {
                    "step": step,
                    "loss": loss,
                    "grad_norm": norm if math.isfinite(norm) else None,
                    "skipped": stats["skipped"],
                    "seconds": round(time.perf_counter() - t0, 4),
                    **swap_figures(engine),
                }
            )
            if manager is not None and engine.step % args.save_every == 0:
                t0 = time.perf_counter()
                engine.save(manager)  # asynchronous: returns once the state is snapshotted
                record = {"checkpoint": engine.step, "stall": round(time.perf_counter() - t0, 4)}
                if engine.last_checkpoint_io:  # offloaded state streamed from the swap files
                    record["tier_read"] = engine.last_checkpoint_io["bytes_read"]
                emit({**record, "async": not args.sync_save})
    finally:
        if manager is not None:
            saved = finish_saves(manager)
        try:
            tier = tier_figures(engine)
        finally:
            engine.close()  # the offload tier's swap directory goes now
    if not saved:
        return 1
    emit(
        {
            "done": True,
            "steps": last - first,
            "seconds": round(time.perf_counter() - start, 3),
            "mesh": engine.mesh.as_dict(),
            "zero": args.zero,
            "precision": args.precision,
            "peak_rss": peak_rss(),  # rank 0's
            **tier,
        }
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def swap_figures(engine: Any) -> dict[str, Any]:
    """The last step's traffic to and from the optimizer's NVMe tier (bytes, and the seconds its I/O threads
    were busy: hidden behind compute or waited for), as ``{"swap": {...}}``; nothing without that tier."""
    offload = engine.optimizer.offload
    if offload is None or offload.device != "nvme" or not offload.last:
        return {}
    last = offload.last
    keys = ("bytes_read", "bytes_written", "io_read", "io_write")
    return {"swap": {k: round(last[k], 4) if k.startswith("io") else int(last[k]) for k in keys if k in last}}


def tier_figures(engine: Any) -> dict[str, Any]:
    """The optimizer tier's shape for the final line: ``{"offload": {device, state_bytes, host_bytes, ...}}``."""
    offload = engine.optimizer.offload
    if offload is None:
        return {}
    shape = offload.describe()
    keep = ("device", "subgroups", "slots", "resident", "swapped_bytes", "host_bytes", "pinned_bytes", "budget")
    return {"offload": {"state_bytes": 12 * sum(offload.sizes), **{k: shape[k] for k in keep if k in shape}}}


def finish_saves(manager: Any) -> bool:
    """Wait for the checkpoint saves in flight and close ``manager``; False (the error printed) if a save
    failed. ``close()`` alone would only log the failure, and the run would end as if all was saved."""
    try:
        manager.wait()
        return True
    except Exception as exc:  # noqa: BLE001 - any failed save fails the run, whatever it raised
        print(f"error: a checkpoint save failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        manager.close()


if __name__ == "__main__":
    import traceback

    from ucp.shutdown import exit_now

    try:
        code: int | str | None = main()
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_now(code)  # all work is done (checkpoints waited for): skip the teardown that can abort
