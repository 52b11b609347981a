#!/usr/bin/env python
"""Step time of the training engine with the optimizer state in memory, on the CPU tier and on the NVMe tier,
against DeepSpeed ZeRO with the same offload configuration, and fio on the same disk.

    .venv/bin/python tools/bench_offload.py --nvme-path /tmp                          # the "small" GPT
    .venv/bin/python tools/bench_offload.py --model gpt-100m --zero 3 --precision bf16 --nvme-path /data \\
        --swap-budget 512MiB --sub-group-size 10000000 --rounds 3

Methods: ``memory`` (no offload), ``cpu`` (offload_optimizer cpu), ``nvme`` (offload_optimizer nvme,
pipelined; the budget beyond the pool's pipeline slots keeps sub-groups resident), ``nvme-swapall`` (``nvme``
with ``keep_resident`` off: every sub-group swapped, the whole budget in slots, as before residency),
``nvme-swapall-4k`` (``nvme-swapall`` with the slots on ordinary 4 KiB pages, not transparent huge pages: the
tier as it was before both; the three apart show what fewer bytes and what less kernel time each gave),
``nvme-serial`` (pipeline_read and pipeline_write off), ``nvme-param`` (``nvme`` and, at ZeRO-3,
offload_param nvme: the parameters on NVMe too, ``--param-buffer-count`` × ``--param-buffer-size`` elements of
pool, ``--max-in-cpu``), ``deepspeed-nvme`` and ``deepspeed-nvme-param`` (DeepSpeed's
engine, CPU accelerator, the same ZeRO stage, model, seed, data and ``zero_optimization`` offload keys;
``tools/peers/deepspeed_offload.py``). Each method runs in its own process (so its peak RSS, VmHWM, is its
own), built one after the other, then the methods take turns (interleaved, in a rotating order). A turn is
a lead-in step and a timed step; after it the method's background I/O is waited for, untimed, so none of it
runs during another method's turn, while the timed step still has the lead-in's write-backs and reads
ahead behind its forward and backward as in a long run. The first turn is a warm-up, not counted.

Per method (medians of the timed steps): whole step, the optimizer's part (read wait, Adam, write wait),
the seconds the I/O threads were busy and the share of them hidden behind other work
(1 - waits / busy), the bytes the process read from and wrote to the device in the timed step
(``/proc/self/io``, so DeepSpeed's are measured, not computed), their rate against fio's O_DIRECT
sequential read and write on the same directory (before and after the steps, two request shapes; the fastest),
peak RSS and locked (pinned) host memory (VmLck). Losses of our methods must agree bit for bit; DeepSpeed's
are compared with a relative tolerance. Progress goes to stderr, markdown to stdout.

Worker protocol (``serve``): the parent writes one JSON line per turn, ``{"steps": [s0, s1]}``; the worker
answers one JSON line ``{"losses", "seconds", "parts", "read_bytes", "written_bytes", "hwm", "locked"}``,
and ``{"ready": ...}`` once built. EOF ends it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from aio.sizes import SIZE_HELP, format_size, parse_size  # noqa: E402
from ucp.bench.report import cpu_model, source_commit  # noqa: E402

OURS = ("memory", "cpu", "nvme", "nvme-swapall", "nvme-swapall-4k", "nvme-serial", "nvme-param")
METHODS = (*OURS, "deepspeed-nvme", "deepspeed-nvme-param")
PEER = REPO / "tools" / "peers" / "deepspeed_offload.py"
# The run both engines train (tests/training/test_deepspeed_parity.py): DeepSpeed's AdamW over one group.
SEED, LR, BETAS, EPS, WEIGHT_DECAY = 1234, 1e-3, (0.9, 0.95), 1e-8, 0.01


# -- what the processes report --------------------------------------------------------------------------------


def proc_status(text: str | None = None) -> dict[str, int]:
    """VmHWM (peak RSS) and VmLck (locked, i.e. pinned, memory) of this process in bytes, from /proc/self/status."""
    if text is None:
        text = Path("/proc/self/status").read_text()
    out = {"hwm": 0, "locked": 0}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmLck"):
            number, unit = value.split()
            if unit != "kB":
                raise ValueError(f"/proc/self/status: {key} in {unit!r}, expected kB")
            out["hwm" if key == "VmHWM" else "locked"] = int(number) * 1024
    return out


def proc_io(text: str | None = None) -> tuple[int, int]:
    """Bytes this process read from and wrote to storage (``/proc/self/io`` read_bytes, write_bytes; O_DIRECT
    I/O counts, page-cache hits do not)."""
    if text is None:
        text = Path("/proc/self/io").read_text()
    fields = dict(line.split(": ") for line in text.splitlines() if ": " in line)
    try:
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except KeyError as exc:
        raise ValueError(f"/proc/self/io: no {exc.args[0]} field") from exc


def protocol_stream() -> IO[str]:
    """The worker's answer stream: the real stdout, while fd 1 and ``sys.stdout`` go to stderr from now on, so that
    a library's prints (DeepSpeed logs to stdout) never land in the protocol."""
    sys.stdout.flush()
    stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def serve(
    step: Callable[[int], float],
    drain: Callable[[], None],
    parts: Callable[[], dict[str, float] | None],
    ready: dict[str, Any],
    *,
    inp: IO[str] | None = None,
    out: IO[str] | None = None,
) -> None:
    """The worker side: answer each turn the parent asks for (see the module docstring) until EOF.

    ``step(s)`` trains global step ``s`` and returns its loss; ``drain()`` waits for I/O the step left running;
    ``parts()`` gives the optimizer's figures of the last step (or None)."""
    inp = sys.stdin if inp is None else inp
    out = sys.stdout if out is None else out
    out.write(json.dumps({"ready": ready}) + "\n")
    out.flush()
    for line in inp:
        if not line.strip():
            continue
        steps = [int(s) for s in json.loads(line)["steps"]]
        losses = [step(s) for s in steps[:-1]]
        r0, w0 = proc_io()
        c0 = os.times()
        t0 = time.perf_counter()
        losses.append(step(steps[-1]))
        seconds = time.perf_counter() - t0
        c1 = os.times()
        cpu = (c1.user - c0.user) + (c1.system - c0.system)  # every thread of the process, user + system
        r1, w1 = proc_io()
        figures = parts()
        drain()
        answer = {"losses": losses, "seconds": seconds, "cpu": cpu, "parts": figures, "read_bytes": r1 - r0}
        answer |= {"written_bytes": w1 - w0, **proc_status()}
        out.write(json.dumps(answer) + "\n")
        out.flush()


# -- our engine's worker ------------------------------------------------------------------------------------------


def ds_offload(method: str, args: argparse.Namespace, nvme_path: str) -> dict[str, Any]:
    """The ``zero_optimization`` offload keys of a method, DeepSpeed's spelling (both engines get the same)."""
    zero: dict[str, Any] = {"stage": args.zero, "sub_group_size": args.sub_group_size}
    if method == "memory":
        return zero
    optimizer: dict[str, Any] = {"device": "cpu", "pin_memory": True}
    if method != "cpu":
        optimizer |= {"device": "nvme", "nvme_path": nvme_path, "buffer_count": args.buffer_count}
        serial = method == "nvme-serial"
        optimizer |= {"pipeline_read": not serial, "pipeline_write": not serial}
    if method == "nvme-param":  # the parameters on NVMe too (ZeRO-3), DeepSpeed's offload_param keys
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "pin_memory": True,
            "buffer_count": args.param_buffer_count,
            "buffer_size": args.param_buffer_size,
            "max_in_cpu": args.max_in_cpu,
        }
    return zero | {"offload_optimizer": optimizer}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Our engine's options for the run DeepSpeed trains (tools/peers/deepspeed_train.py's defaults)."""
    return dict(
        zero_stage=args.zero,
        dtype=args.precision,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        lr=LR,
        beta1=BETAS[0],
        beta2=BETAS[1],
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        optimizer="adamw",
        clip=None,
        seed=SEED,
        data_seed=SEED,
        pad_vocab_to=1,
    )


def run_worker(method: str, args: argparse.Namespace) -> int:
    """One of our methods in this process, served to the parent."""
    out = protocol_stream()
    from training import Engine
    from training.offload import OffloadConfig

    if method == "nvme-swapall-4k":  # the slots on ordinary pages (this process only)
        import training.offload.store

        training.offload.store.HUGE_PAGES = False
    offload = OffloadConfig.from_deepspeed(
        ds_offload(method, args, args.nvme_path),
        swap_budget=args.swap_budget,
        keep_resident=not method.startswith("nvme-swapall"),
    )
    engine = Engine(args.model, offload=offload, **engine_options(args))
    # DeepSpeed's single AdamW group decays every parameter: give our no-decay group the same decay.
    engine.optimizer.weight_decay = [WEIGHT_DECAY] * len(engine.optimizer.weight_decay)
    off = engine.optimizer.offload

    def drain() -> None:
        # The write-backs the step left behind and the reads it started for the next step (waiting leaves them
        # in place, as the next step expects).
        if off is not None:
            off.wait_io()

    def parts() -> dict[str, float] | None:
        return dict(off.last) if off is not None else None

    params = engine.optimizer.param_tier
    if params is not None:  # the parameter tier's figures per step (of the turn's steps: lead-in and timed)
        seen: dict[str, float] = {}
        per_turn = args.lead_in + 1
        optimizer_parts = parts

        def parts() -> dict[str, float] | None:
            assert params is not None
            now = params.offload.stats()
            delta = {f"param_{k}": (v - seen.get(k, 0.0)) / per_turn for k, v in now.items()}
            seen.update(now)
            return (optimizer_parts() or {}) | delta

    state = 12 * sum(pl.size for pl in engine.optimizer.plans)
    tier = off.describe() if off is not None else {}
    if params is not None:
        tier = tier | {"params": params.offload.describe()}
    try:
        serve(engine.train_step, drain, parts, {"state_bytes": state, "tier": tier}, out=out)
    finally:
        engine.close()
    return 0


# -- the parent ------------------------------------------------------------------------------------------------


FIO_SHAPES = (("8M", 8), ("1M", 32))  # request size, queue depth: the faster counts (as in bench_cold_load.py)


def fio(directory: Path, size: str) -> dict[str, float]:
    """fio's O_DIRECT sequential write, then read, of one file in ``directory`` (libaio), each in the request
    shapes of ``FIO_SHAPES``: GB/s of the faster shape, for write and for read."""
    path = directory / f"ucp-bench-fio-{os.getpid()}"
    out: dict[str, float] = {"write": 0.0, "read": 0.0}
    try:
        for bs, depth in FIO_SHAPES:
            for rw in ("write", "read"):
                done = subprocess.run(
                    [
                        "fio", f"--name={rw}", f"--filename={path}", f"--rw={rw}", "--direct=1", f"--bs={bs}",
                        f"--iodepth={depth}", "--ioengine=libaio", f"--size={size}", "--output-format=json",
                    ],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                job = json.loads(done.stdout)["jobs"][0][rw]
                out[rw] = max(out[rw], float(job["bw_bytes"]) / 1e9)
    finally:
        path.unlink(missing_ok=True)
    return out


class Worker:
    """A method's process: started, built, then asked for turns."""

    def __init__(self, method: str, argv: list[str], args: argparse.Namespace) -> None:
        self.method = method
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        if method.startswith("deepspeed"):
            ds = ds_offload(method.removeprefix("deepspeed-"), args, str(args.nvme_path))
            cmd = [sys.executable, str(PEER), "--model", args.model, "--zero-stage", str(args.zero)]
            cmd += ["--dtype", args.precision, "--micro-batch", str(args.micro_batch), "--seq", str(args.seq_len)]
            cmd += ["--seed", str(SEED), "--zero-config", json.dumps(ds)]
            env["DS_ACCELERATOR"] = "cpu"
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", method]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready: dict[str, Any] = self._answer()["ready"]

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.method}: the worker exited (rc {self.proc.wait()}); see its stderr above")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def turn(self, steps: list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"steps": steps}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    from training.models.gpt import PRESETS

    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    p.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="measured turns per method (after a warm-up turn)")
    p.add_argument("--lead-in", type=int, default=1, help="untimed steps before the timed one in each turn")
    p.add_argument("--nvme-path", type=Path, required=True, help="directory for the NVMe tiers and fio")
    p.add_argument("--sub-group-size", type=int, default=10_000_000, help="elements per sub-group")
    p.add_argument("--buffer-count", type=int, default=16, help="offload_optimizer.buffer_count (both engines)")
    p.add_argument("--swap-budget", default="512MiB", help=f"our NVMe tier's pool budget ({SIZE_HELP})")
    p.add_argument("--param-buffer-count", type=int, default=5, help="offload_param.buffer_count (both engines)")
    p.add_argument("--param-buffer-size", type=int, default=10_000_000, help="offload_param.buffer_size (both)")
    p.add_argument("--max-in-cpu", type=int, default=0, help="offload_param.max_in_cpu (both engines)")
    p.add_argument("--fio-size", default="1G", help="fio's file size")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--worker", choices=OURS, help=argparse.SUPPRESS)
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    args.swap_budget = parse_size(args.swap_budget, what="--swap-budget")
    args.method_list = [m for m in args.methods.split(",") if m]
    if bad := [m for m in args.method_list if m not in METHODS]:
        p.error(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    if args.rounds < 1 or args.lead_in < 0:
        p.error("--rounds must be >= 1 and --lead-in >= 0")
    return args


def hidden(f: dict[str, float]) -> float | None:
    """Share of the I/O threads' busy time that no one waited for (None without I/O)."""
    busy = f.get("io_read", 0.0) + f.get("io_write", 0.0)
    if not busy:
        return None
    return max(0.0, 1 - (f.get("read_wait", 0.0) + f.get("write_wait", 0.0)) / busy)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker:
        return run_worker(args.worker, args)
    methods = args.method_list
    load = os.getloadavg()[0]
    worker_argv = list(argv)  # the workers parse the same options
    speeds = [fio(args.nvme_path, args.fio_size)]
    print(f"fio: {speeds[0]}", file=sys.stderr, flush=True)
    workers: dict[str, Worker] = {}
    turns: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    try:
        for m in methods:
            print(f"building {m} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            workers[m] = Worker(m, worker_argv, args)
            print(f"  {m} ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        per_turn = args.lead_in + 1
        for r in range(args.rounds + 1):  # round 0: warm-up
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            steps = list(range(r * per_turn, (r + 1) * per_turn))
            for m in order:
                turns[m].append(workers[m].turn(steps))
            print(
                f"round {r}: " + ", ".join(f"{m} {turns[m][-1]['seconds']:.3f}s" for m in methods),
                file=sys.stderr,
                flush=True,
            )
    finally:
        for w in workers.values():
            w.close()
    speeds.append(fio(args.nvme_path, args.fio_size))
    print(f"fio: {speeds[1]}", file=sys.stderr, flush=True)
    load_after = os.getloadavg()[0]
    print(report(args, argv, methods, workers, turns, speeds, (load, load_after)))
    ours = [m for m in methods if m in OURS]
    return 0 if all(losses(turns[m]) == losses(turns[ours[0]]) for m in ours) else 1


def losses(turns: list[dict[str, Any]]) -> list[float]:
    return [x for t in turns for x in t["losses"]]


def report(
    args: argparse.Namespace,
    argv: list[str],
    methods: list[str],
    workers: dict[str, Worker],
    turns: dict[str, list[dict[str, Any]]],
    speeds: list[dict[str, float]],
    loads: tuple[float, float],
) -> str:
    """The markdown: header, table, the issue's targets."""
    import torch

    med = statistics.median
    reads, writes = [s["read"] for s in speeds], [s["write"] for s in speeds]
    fio_r, fio_w = max(reads), max(writes)
    step = {m: med(t["seconds"] for t in turns[m][1:]) for m in methods}
    rss = {m: max(t["hwm"] for t in turns[m]) for m in methods}
    # the process's CPU seconds (all threads) in the timed step: on a shared machine, what the wall time cannot say
    cpu = {m: f"{med(t['cpu'] for t in turns[m][1:]):.2f}" if "cpu" in turns[m][0] else "–" for m in methods}
    locked = {m: max(t["locked"] for t in turns[m]) for m in methods}
    moved = {
        m: (med(t["read_bytes"] for t in turns[m][1:]), med(t["written_bytes"] for t in turns[m][1:])) for m in methods
    }
    parts: dict[str, dict[str, float]] = {}
    for m in methods:
        timed = [t["parts"] for t in turns[m][1:] if t["parts"]]
        if timed:
            parts[m] = {k: med(x[k] for x in timed) for k in timed[0]}
    ours = [m for m in methods if m in OURS]
    agree = all(losses(turns[m]) == losses(turns[ours[0]]) for m in ours) if ours else True
    state = next((w.ready.get("state_bytes") for w in workers.values() if "state_bytes" in w.ready), None)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Measured at commit {source_commit(REPO)}, recorded {date}, {cpu_model()} ({os.cpu_count()} vCPUs), "
        f"torch {torch.__version__}; load average before {loads[0]:.2f}, after {loads[1]:.2f}",
        "",
        f"Command: `.venv/bin/python tools/bench_offload.py {' '.join(argv)}` (one process per method; "
        f"{args.rounds} interleaved turns after a warm-up turn, each {args.lead_in} lead-in step(s) + 1 timed; medians)",
        "",
        f"Model `{args.model}`, ZeRO-{args.zero}, {args.precision}, micro-batch {args.micro_batch} x {args.seq_len} tokens; "
        + (f"fp32 master + moments {format_size(state)}; " if state else "")
        + f"sub_group_size {args.sub_group_size}, buffer_count {args.buffer_count}, our swap_budget "
        f"{format_size(args.swap_budget)}. fio O_DIRECT on the same directory (the faster of 8 MiB x QD 8 and 1 MiB x QD 32, {args.fio_size}; before / after): "
        f"read {' / '.join(f'{s_read:.2f}' for s_read in reads)} GB/s, write {' / '.join(f'{s_w:.2f}' for s_w in writes)} GB/s. "
        f"Losses bit-equal across our methods: {'yes' if agree else 'NO'}.",
    ]
    if ours:
        ref = losses(turns[ours[0]])
        for m in methods:
            if m not in OURS:
                theirs = losses(turns[m])
                rel = max(abs(a - b) / abs(b) for a, b in zip(theirs, ref))
                lines[-1] += f" {m} losses against ours: max relative difference {rel:.1e}."
    lines += [
        "",
        "| method | step s | CPU s | × memory | optimizer s | read wait s | Adam s | in backward | write wait s | I/O busy s "
        "| hidden | read MB/step | written MB/step | swap GB/s | vs fio | peak RSS | locked | tier host bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = step.get("memory")
    for m in methods:
        r, w = moved[m]
        f = parts.get(m)
        ratio = f"{step[m] / base:.2f}" if base else "–"
        cells = ["–"] * 7
        rate = vs = "–"
        tier = workers[m].ready.get("tier") or {}
        host = format_size(tier["host_bytes"]) if "host_bytes" in tier else "–"
        if f:
            h = hidden(f)
            adam = f["compute"] + f.get("early_compute", 0.0)  # in step() and, armed, during backward
            early = f"{f.get('early', 0.0):.0f}/{tier.get('subgroups', '?')}"
            cells = [f"{f['seconds']:.3f}", f"{f['read_wait']:.3f}", f"{adam:.3f}", early, f"{f['write_wait']:.3f}"]
            cells += [f"{f['io_read'] + f['io_write']:.3f}", f"{h:.0%}" if h is not None else "–"]
            if r + w:
                # the swap's own rate: the bytes over the seconds the I/O threads were busy, against fio's
                busy = f["io_read"] + f["io_write"]
                rate = f"{(r + w) / busy / 1e9:.2f}" if busy else "–"
                vs = f"{(r / fio_r + w / fio_w) / 1e9 / busy:.0%}" if busy else "–"
        elif r + w:  # DeepSpeed: the bytes over the whole step (its swap time is not exposed)
            rate = f"{(r + w) / step[m] / 1e9:.2f} (per step s)"
        lines.append(
            f"| {m} | {step[m]:.3f} | {cpu[m]} | {ratio} | {' | '.join(cells)} | {r / 1e6:.0f} | {w / 1e6:.0f} | {rate} | {vs} "
            f"| {format_size(rss[m])} | {format_size(locked[m])} | {host} |"
        )
    shapes = []
    for m in methods:  # where each NVMe tier's budget went, and so what it moves per step
        tier = workers[m].ready.get("tier") or {}
        if "slots" in tier:
            shapes.append(
                f"{m} {tier['slots']} slot(s) × {format_size(tier['slot_bytes'])}, {tier.get('resident', 0)} of "
                f"{tier['subgroups']} sub-groups resident ({format_size(tier.get('resident_bytes', 0))}), "
                f"{format_size(tier.get('swapped_bytes', 0))} swapped each way per step"
            )
    if shapes:
        lines += ["", "NVMe tiers (pool, resident sub-groups, state swapped): " + "; ".join(shapes) + "."]
    lines += [
        "",
        "Per-turn step seconds (warm-up first): "
        + "; ".join(f"{m} " + " / ".join(f"{t['seconds']:.2f}" for t in turns[m]) for m in methods)
        + ".",
    ]
    lines += ["", *targets(step, parts, moved, rss, locked, fio_r, fio_w)]
    lines += param_lines(args, methods, step, parts, moved, rss, locked)
    return "\n".join(lines)


def param_lines(
    args: argparse.Namespace,
    methods: list[str],
    step: dict[str, float],
    parts: dict[str, dict[str, float]],
    moved: dict[str, tuple[float, float]],
    rss: dict[str, int],
    locked: dict[str, int],
) -> list[str]:
    """The parameters-on-NVMe methods (ZeRO-3 offload_param nvme): their tier's figures and the comparison with
    DeepSpeed on the same offload_param keys."""
    if "nvme-param" not in methods:
        return []
    f = parts.get("nvme-param", {})
    out = [
        "",
        f"Parameters on NVMe (offload_param nvme, buffer_count {args.param_buffer_count}, buffer_size "
        f"{args.param_buffer_size}, max_in_cpu {args.max_in_cpu}; both engines):",
        "",
    ]
    if "param_bytes_read" in f:
        loads, hits = f["param_loads"], f["param_hits"]
        out.append(
            f"* nvme-param's parameter tier per step: read {f['param_bytes_read'] / 1e6:.0f} MB, written "
            f"{f['param_bytes_written'] / 1e6:.0f} MB, I/O threads busy {f['param_io_read'] + f['param_io_write']:.3f} s, "
            f"gathers waited {f['param_read_wait']:.3f} s for reads; {hits:.0f} of {loads:.0f} partition loads read "
            "ahead in full"
        )
    ds = "deepspeed-nvme-param"
    if ds in step:
        r, w = moved["nvme-param"]
        dr, dw = moved[ds]
        out.append(
            f"* nvme-param {step['nvme-param']:.3f} s/step against DeepSpeed's {step[ds]:.3f} s "
            f"({step[ds] / step['nvme-param']:.2f}× faster); read/written per step {r / 1e6:.0f}/{w / 1e6:.0f} MB "
            f"against {dr / 1e6:.0f}/{dw / 1e6:.0f} MB; peak RSS {format_size(rss['nvme-param'])} against "
            f"{format_size(rss[ds])}; locked {format_size(locked['nvme-param'])} against {format_size(locked[ds])}"
        )
    return out


def targets(
    step: dict[str, float],
    parts: dict[str, dict[str, float]],
    moved: dict[str, tuple[float, float]],
    rss: dict[str, int],
    locked: dict[str, int],
    fio_r: float,
    fio_w: float,
) -> list[str]:
    """Issue 17's targets, each with its numbers and met / NOT met."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    out = ["Targets (issue 17):", ""]
    if "nvme" in parts and "cpu" in parts:
        r, w = moved["nvme"]
        move = r / (fio_r * 1e9) + w / (fio_w * 1e9)
        adam = parts["cpu"]["compute"] + parts["cpu"].get("early_compute", 0.0)
        bound = 1.2 * max(move, adam)
        got = parts["nvme"]["seconds"]
        out.append(
            f"* NVMe optimizer step {got:.3f} s ≤ 1.2 × max(moving its state at fio's speeds {move:.3f} s, "
            f"Adam alone (the CPU tier's optimizer step) {adam:.3f} s) = {bound:.3f} s: {verdict(got <= bound)}"
        )
    ds = next((m for m in step if m.startswith("deepspeed")), None)
    if "nvme" in step and ds:
        speedup = step[ds] / step["nvme"]
        out.append(
            f"* NVMe whole step {step['nvme']:.3f} s ≥ 1.5× faster than DeepSpeed's {step[ds]:.3f} s: "
            f"{speedup:.2f}×, {verdict(speedup >= 1.5)}"
        )
        out.append(
            f"* host memory ≤ half DeepSpeed's: peak RSS {format_size(rss['nvme'])} against {format_size(rss[ds])} "
            f"({rss['nvme'] / rss[ds]:.2f}): {verdict(rss['nvme'] <= rss[ds] / 2)}; locked (pinned) "
            f"{format_size(locked['nvme'])} against {format_size(locked[ds])}: {verdict(locked['nvme'] <= locked[ds] / 2)}"
        )
    if "nvme" in step and "cpu" in step:
        ratio = step["nvme"] / step["cpu"]
        out.append(
            f"* NVMe whole step ≤ 1.25 × our CPU-offload step ({step['cpu']:.3f} s): {ratio:.2f}×, {verdict(ratio <= 1.25)}"
        )
    for m, what in (("nvme-swapall", "every sub-group swapped"), ("nvme-swapall-4k", "and on 4 KiB pages")):
        if m in step and "cpu" in step:
            out.append(f"  ({what}, `{m}`: {step[m]:.3f} s, {step[m] / step['cpu']:.2f}× the CPU tier)")
    return out


if __name__ == "__main__":
    sys.exit(main())
