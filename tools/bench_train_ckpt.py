"""What checkpointing every step costs a training run: none vs async vs sync, in one run.

    python tools/bench_train_ckpt.py --model small --steps 8 --dp 2 --zero 2          # spawns 2 gloo ranks
    torchrun --nproc-per-node 2 tools/bench_train_ckpt.py --model small --dp 2       # or under torchrun
    python tools/bench_train_ckpt.py --json out.json ...                             # also write the results

Every rank trains the reference GPT (``training.Engine``) three ways, one after the other, on the
same engine: ``none`` (no checkpoints), ``async`` (``engine.save`` through
``ucp.CheckpointManager(root, keep_last=2, async_save=True)`` after every step) and ``sync`` (the same
manager with synchronous saves). The ways are interleaved in ``--rounds`` rounds (so load from other
jobs drifting over the run hits each alike); a way's first block starts with ``--warmup`` untimed steps
(the first save allocates and faults the staging arena, plans the layout). A step's
time is ``train_step`` plus the save call, measured on rank 0 (the collectives keep ranks in step).

Reported: the median step time of each way, the overhead ratio ``(way - none) / none``, the
checkpoint size (all ranks' files), the snapshot stall per async save (``SaveHandle.snapshot_seconds``),
how long an async save takes to become durable, and the sync save's GB/s.

Knobs that matter on small machines: ``--threads`` (torch intra-op threads per rank; default cores /
ranks, so the ranks do not oversubscribe the CPU), ``--async-mode process`` (the writer in its own
process: no GIL shared with training), ``--writer-threads`` (the aio engine's threads) and
``--no-fsync``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.argtypes import positive_int  # noqa: E402

WAYS = ("none", "async", "sync", "tiered")
DEFAULT_WAYS = ("none", "async", "sync")
STOP_GRACE_S = 5.0  # after Ctrl-C: how long the ranks get to exit on SIGTERM before SIGKILL


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="small", help="preset of training.models.gpt.PRESETS (default: small, 13.8M)")
    p.add_argument("--steps", type=positive_int, default=8, help="timed steps per way")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per way (the first save warms up)")
    p.add_argument(
        "--rounds", type=positive_int, default=2, help="interleave the ways in this many rounds of steps / rounds"
    )
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--pp", type=positive_int, default=1)
    p.add_argument("--dp", type=positive_int, default=None, help="default: procs / (tp * pp)")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument(
        "--procs", type=positive_int, default=None, help="ranks to spawn (default tp * pp * dp, dp default 1)"
    )
    p.add_argument("--micro-batch", type=positive_int, default=2)
    p.add_argument("--seq-len", type=positive_int, default=None, help="default: the model's max_seq")
    p.add_argument(
        "--ways",
        nargs="+",
        default=list(DEFAULT_WAYS),
        choices=WAYS,
        help="tiered: async saves committed locally, then replicated to --remote (default: a loopback moto "
        "S3 server started for the run) by the manager's Replicator",
    )
    p.add_argument("--every", type=positive_int, default=1, help="save after every N steps (all ways)")
    p.add_argument("--remote", default=None, help="the tiered way's object-store root (s3://bucket/prefix)")
    p.add_argument(
        "--server-nice",
        type=int,
        default=19,
        help="niceness of the loopback S3 server's process (default 19: it stands in for an endpoint off this "
        "machine, so it gets the cores training leaves idle instead of taking them from training; 0: as the "
        "ranks). Its CPU seconds per replicated checkpoint are reported",
    )
    p.add_argument("--dir", type=Path, default=None, help="checkpoint root parent (default: a temp dir under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--async-mode", default="thread", choices=("thread", "process"))
    p.add_argument(
        "--snapshot",
        default="auto",
        choices=("auto", "cow", "sync", "background", "none"),
        help="async saves: write-protect and copy from a helper process (cow; auto picks it where Linux "
        "allows it, else sync), copy the state before save() returns (sync), copy it in the "
        "background (background), or copy nothing and write straight from the tensors (none); the "
        "engine waits for a background copy or a write before its next optimizer step",
    )
    p.add_argument("--writer-threads", type=positive_int, default=None, help="aio thread_count for the writes")
    p.add_argument("--no-fsync", action="store_true", help="skip fdatasync of the data files")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one rank ------------------------------------------------------------------------------------


def run_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    """Train the three ways on this rank; rank 0 returns the measurements."""
    import torch
    import torch.distributed as dist

    import ucp
    from training import Engine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    dp = args.dp or world // (args.tp * args.pp)
    engine = Engine(
        args.model,
        mesh={"tp": args.tp, "pp": args.pp, "dp": dp},
        zero_stage=args.zero,
        dtype=args.precision,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        lr=1e-4,
    )
    aio: dict[str, Any] = {}
    if args.writer_threads:
        aio["thread_count"] = args.writer_threads
    if args.no_fsync:
        aio["fsync"] = False
    base = Path(os.environ["BENCH_ROOT"])
    managers: dict[str, Any] = {}
    savers: dict[str, Any] = {}
    raw: dict[str, dict[str, list[float]]] = {
        w: {"step_s": [], "save_call_s": [], "stall_s": [], "durable_s": [], "wait_s": [], "replicate_s": []}
        for w in args.ways
    }
    waits: list[float] = []  # time train_step spent waiting for a background snapshot (before its optimizer step)
    engine_wait = engine.wait_snapshot

    def timed_wait() -> None:
        t = time.perf_counter()
        engine_wait()
        waits.append(time.perf_counter() - t)

    engine.wait_snapshot = timed_wait
    for w in args.ways:
        if w in ("async", "tiered"):
            savers[w] = ucp.AsyncSaver(mode=args.async_mode, aio_config=aio or None, snapshot=args.snapshot)
        if w != "none":
            remote = os.environ.get("BENCH_REMOTE") or args.remote if w == "tiered" else None
            managers[w] = ucp.CheckpointManager(
                base / w,
                keep_last=2,
                async_save=w in ("async", "tiered"),
                saver=savers.get(w),
                aio_config=aio or None,
                remote=remote,
                remote_keep_last=2 if remote else None,
            )
    # Rounds interleave the ways, so load from other jobs drifting over the run hits every way alike.
    per_round = max(1, -(-args.steps // args.rounds))
    for rnd in range(args.rounds):
        for way in args.ways:
            manager, r = managers.get(way), raw[way]
            warm = args.warmup if rnd == 0 else 0
            for i in range(warm + per_round):
                t0 = time.perf_counter()
                waits.clear()
                engine.train_step()
                t1 = time.perf_counter()
                if i >= warm and manager is not None and i > 0:
                    r["wait_s"].append(sum(waits))
                if manager is not None and (i + 1) % args.every == 0:
                    out = engine.save(manager)
                    if isinstance(out, ucp.SaveHandle) and i >= warm:
                        r["stall_s"].append(out.snapshot_seconds)

                        def durable(
                            _h: ucp.SaveHandle,
                            t: float = time.perf_counter(),
                            s: float = out.snapshot_seconds,
                            d: list[float] = r["durable_s"],
                        ) -> None:
                            d.append(time.perf_counter() - t + s)

                        out.add_done_callback(durable)
                t2 = time.perf_counter()
                if i >= warm:
                    r["step_s"].append(t2 - t0)
                    r["save_call_s"].append(t2 - t1)
            if manager is not None:
                manager.wait()  # untimed: the next way starts without this way's writes in flight
            if dist.is_initialized():
                dist.barrier()
    results: dict[str, Any] = {}
    for way in args.ways:
        size = 0
        manager = managers.get(way)
        if manager is not None:
            manager.close()
            if manager.replicator is not None:  # every replication, timed by the Replicator
                raw[way]["replicate_s"] = list(manager.replicator.replicated.values())
            if way in savers:
                savers[way].close()
            if rank == 0:
                size = sum(f.stat().st_size for f in Path(manager.path(manager.latest())).iterdir() if f.is_file())
        results[way] = {**raw[way], "size": size}
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank != 0:
        return None
    results["config"] = {
        "model": args.model,
        "params": engine.cfg.model.num_params(),
        "world": world,
        "tp": args.tp,
        "pp": args.pp,
        "dp": dp,
        "zero": args.zero,
        "precision": args.precision,
        "micro_batch": args.micro_batch,
        "seq": engine.cfg.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "async_mode": args.async_mode,
        "snapshot": args.snapshot,
        "every": args.every,
        "aio": aio,
        "cores": os.cpu_count(),
    }
    return results


# -- summary -------------------------------------------------------------------------------------


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians, overhead ratios and rates from the raw per-step measurements."""
    med = {w: statistics.median(r["step_s"]) for w, r in raw.items() if w in WAYS and r["step_s"]}
    out: dict[str, Any] = {"config": raw["config"], "ways": {}}
    if "server" in raw:  # the loopback S3 server's CPU over the run, per replicated checkpoint
        n = len(raw.get("tiered", {}).get("replicate_s", []))
        out["server"] = {**raw["server"], "replicated": n, "cpu_s_per_checkpoint": raw["server"]["cpu_s"] / max(n, 1)}
    for w in WAYS:
        if w not in raw:
            continue
        r = raw[w]
        row: dict[str, Any] = {"median_step_s": med.get(w)}
        if "none" in med and w != "none" and w in med:
            row["overhead"] = (med[w] - med["none"]) / med["none"]
        if r["step_s"]:  # with --every N the median is a step without a save: the mean counts the saves
            row["mean_step_s"] = statistics.fmean(r["step_s"])
            if w != "none" and raw.get("none", {}).get("step_s"):
                base = statistics.fmean(raw["none"]["step_s"])
                row["mean_overhead"] = (row["mean_step_s"] - base) / base
        if w != "none":
            row["size_bytes"] = r["size"]
            row["median_save_call_s"] = statistics.median(r["save_call_s"]) if r["save_call_s"] else None
        if w in ("async", "tiered") and r["stall_s"]:
            row["median_stall_s"] = statistics.median(r["stall_s"])
            row["max_stall_s"] = max(r["stall_s"])
            if r["wait_s"]:  # background snapshots: what the next step waited for the copy
                row["median_snapshot_wait_s"] = statistics.median(r["wait_s"])
            if r["durable_s"]:
                row["median_durable_s"] = statistics.median(r["durable_s"])
                row["durable_GBps"] = r["size"] / row["median_durable_s"] / 1e9
        if r.get("replicate_s"):  # tiered: the upload behind the local commit, reported apart from it
            row["median_replicate_s"] = statistics.median(r["replicate_s"])
            row["replicate_GBps"] = r["size"] / row["median_replicate_s"] / 1e9
        if w == "sync" and r["save_call_s"]:
            row["sync_GBps"] = r["size"] / statistics.median(r["save_call_s"]) / 1e9
        out["ways"][w] = row
    return out


def table(summary: dict[str, Any]) -> str:
    c = summary["config"]
    lines = [
        f"{c['model']} ({c['params'] / 1e6:.1f}M params), world {c['world']} (tp {c['tp']} pp {c['pp']} "
        f"dp {c['dp']}), ZeRO-{c['zero']} {c['precision']}, micro-batch {c['micro_batch']} x seq {c['seq']}, "
        f"{c['steps']} timed steps after {c['warmup']}, {c['threads']} torch threads/rank on {c['cores']} cores, "
        f"a save every {c.get('every', 1)} step(s)",
        "",
        "| way | median step s | overhead | mean step s (overhead) | save call s | stall s | ckpt MB | GB/s "
        "| local commit s | replicate s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, r in summary["ways"].items():
        ov = f"{r['overhead'] * 100:+.1f}%" if "overhead" in r else "-"
        mean = f"{r['mean_step_s']:.3f}" if "mean_step_s" in r else "-"
        if "mean_overhead" in r:
            mean += f" ({r['mean_overhead'] * 100:+.1f}%)"
        call = f"{r['median_save_call_s']:.3f}" if r.get("median_save_call_s") is not None else "-"
        stall = f"{r['median_stall_s']:.3f}" if "median_stall_s" in r else "-"
        if r.get("median_snapshot_wait_s"):
            stall += f" + {r['median_snapshot_wait_s']:.3f} wait"
        size = f"{r['size_bytes'] / 1e6:.0f}" if r.get("size_bytes") else "-"
        rate = r.get("sync_GBps") or r.get("durable_GBps")
        commit = f"{r['median_durable_s']:.3f}" if "median_durable_s" in r else "-"
        repl = f"{r['median_replicate_s']:.3f}" if "median_replicate_s" in r else "-"
        lines.append(
            f"| {w} | {r['median_step_s']:.3f} | {ov} | {mean} | {call} | {stall} | {size} | {f'{rate:.2f}' if rate else '-'} "
            f"| {commit} | {repl} |"
        )
    lines.append("")
    lines.append(
        "GB/s: sync = size / save call; async and tiered = size / time from save() to durable (the local "
        "commit). replicate s: the tiered way's upload of a committed checkpoint to the object store "
        "(its manifest last, then latest), behind training."
    )
    if "server" in summary:
        srv = summary["server"]
        lines.append(
            f"loopback S3 server (its own process, nice {srv['nice']}): {srv['cpu_s']:.1f} CPU s over the run, "
            f"{srv['cpu_s_per_checkpoint']:.2f} per replicated checkpoint ({srv['replicated']})."
        )
    lines.append(
        "stall: how long save() kept the caller (+ with --snapshot background: how long the next "
        "step waited for the copy before its optimizer step)."
    )
    return "\n".join(lines)


# -- launching -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, argv: Sequence[str], root: Path) -> dict[str, Any]:
    """Spawn the ranks (gloo over loopback); rank 0 writes its results to a file."""
    procs = args.procs or args.tp * args.pp * (args.dp or 1)
    result = root / "rank0.json"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(procs),
        "GLOO_SOCKET_IFNAME": "lo",
        "BENCH_ROOT": str(root),
        "BENCH_RESULT": str(result),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    children: list[subprocess.Popen[bytes]] = []
    try:
        for r in range(procs):
            children.append(
                subprocess.Popen(
                    [sys.executable, __file__, *argv, "--worker"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}
                )
            )
        codes = [c.wait() for c in children]
    except BaseException:  # Ctrl-C (or a failed start): no rank may outlive us, or train on in a deleted root
        _stop(children)
        raise
    if any(codes):
        raise SystemExit(f"bench_train_ckpt: ranks exited with {codes}")
    return json.loads(result.read_text())


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the ranks, give them STOP_GRACE_S to exit, then kill what is left (also when
    a second Ctrl-C cuts the wait short)."""
    try:
        for c in children:
            if c.poll() is None:
                c.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for c in children:
            try:
                c.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker or "TORCHELASTIC_RUN_ID" in os.environ:  # a spawned rank, or under torchrun
        own_root = "BENCH_ROOT" not in os.environ
        if own_root:
            os.environ["BENCH_ROOT"] = tempfile.mkdtemp(prefix="bench-train-ckpt-", dir=args.dir)
        raw = run_rank(args)
        if raw is None:
            return 0
        if "BENCH_RESULT" in os.environ:
            Path(os.environ["BENCH_RESULT"]).write_text(json.dumps(raw))
            return 0
        report(args, raw, Path(os.environ["BENCH_ROOT"]))
        return 0
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-train-ckpt-", dir=args.dir))
    server: subprocess.Popen[str] | None = None
    try:
        if "tiered" in args.ways and args.remote is None:  # a loopback S3 server for this run
            server = start_server(args.server_nice)
            cpu0 = process_cpu_s(server.pid)
        raw = launch(args, argv, root)
        if server is not None:
            raw["server"] = {"nice": args.server_nice, "cpu_s": process_cpu_s(server.pid) - cpu0}
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(args, raw, root)
    return 0


def start_server(nice: int) -> subprocess.Popen[str]:
    """``tools/s3_server.py`` in a process of its own at niceness ``nice``, with a bucket for the run; this
    process's environment then points at it (BENCH_REMOTE and the AWS variables, inherited by the ranks)."""
    server = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "s3_server.py"), "--bucket", "bench-train-ckpt"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )
    assert server.stdout is not None
    for line in server.stdout:  # "export KEY=VALUE" lines, then it serves
        if not line.startswith("export "):
            break
        key, _, value = line[len("export ") :].strip().partition("=")
        os.environ[key] = value
        if key == "AWS_EC2_METADATA_DISABLED":  # the last one it prints
            break
    threading.Thread(target=server.stdout.read, daemon=True).start()  # never let its pipe fill
    if "AWS_ENDPOINT_URL" not in os.environ:
        server.kill()
        raise SystemExit("bench_train_ckpt: the loopback S3 server did not start")
    os.environ["BENCH_REMOTE"] = "s3://bench-train-ckpt/run"
    return server


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(args: argparse.Namespace, raw: dict[str, Any], root: Path) -> None:
    summary = summarize(raw)
    print(table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps({**summary, "raw": raw}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
