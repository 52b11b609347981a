"""``ucp demo``: the whole story on one machine — train, crash, resume elsewhere, reshape, export.

1. **Train** the reference GPT with 4 processes (torchrun, gloo): TP 2 × DP 2, ZeRO-2, fp32,
   an asynchronous checkpoint every ``save_every`` steps through a ``ucp.CheckpointManager``.
2. **Crash**: after step ``kill_at`` every process is SIGKILLed, whatever it is doing (a
   checkpoint may be in flight: it must not matter). The repeated steps are then always at least
   the crash step, whichever checkpoint turns out to be the latest complete one.
3. **Resume** on 2 processes with another layout (TP 1 × DP 2, ZeRO-3): ``engine.load`` picks the
   latest *complete* checkpoint and reshards it while loading. The steps the first run had
   already done are computed again: their losses must equal the first run's.
4. **Reshape** the last checkpoint with ``ucp reshape`` (consolidated), **export** it to Hugging
   Face safetensors with ``ucp export``.
5. **Offload**: train the first steps again with the optimizer state on NVMe (``offload_optimizer:
   nvme``, a swap pool a fraction of the state's size), save (streamed from the swap files), resume in
   new processes; the losses must be the first run's. Then print a summary (with this leg's peak RSS
   and swap traffic).

Every command is run as a user would type it (the lines are shown), so the demo is also a
recipe. All files go to a work directory (a new temporary one unless given), kept at the end.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
Say = Callable[[str], None]


class DemoConfig(BaseModel):
    workdir: Path | None = None
    model: str = "small"
    total_steps: int = 16
    save_every: int = 3
    kill_at: int = 10
    first_procs: int = 4
    first_layout: dict[str, int] = {"tp": 2, "dp": 2, "zero": 2}
    second_procs: int = 2
    second_layout: dict[str, int] = {"tp": 1, "dp": 2, "zero": 3}
    offload_procs: int = 2
    offload_layout: dict[str, int] = {"tp": 1, "dp": 2, "zero": 1}
    offload_steps: int = 2  # trained, then saved; the resumed run does one more
    swap_budget: str = "24MiB"  # the swap pool per rank (the 'small' model's state is 83 MB per rank)
    sub_group_size: int = 1_000_000  # 12 MB records: two fit the pool
    timeout_s: float = 480


@dataclass
class RunLog:
    """What rank 0 of a training run printed (its JSON lines), by kind."""

    losses: dict[int, float] = field(default_factory=dict)
    step_seconds: dict[int, float] = field(default_factory=dict)
    swap: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> its NVMe swap traffic (offload)
    stalls: list[float] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    tier_read: list[int] = field(default_factory=list)  # per checkpoint: bytes read from the swap files
    resumed: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    killed: bool = False
    output: list[str] = field(default_factory=list)

    def take(self, line: str) -> dict[str, Any] | None:
        self.output.append(line)
        try:
            rec = json.loads(line)
        except ValueError:
            return None
        if not isinstance(rec, dict):
            return None
        if "loss" in rec:
            self.losses[int(rec["step"])] = float(rec["loss"])
            self.step_seconds[int(rec["step"])] = float(rec["seconds"])
            if "swap" in rec:
                self.swap[int(rec["step"])] = rec["swap"]
        elif "checkpoint" in rec:
            self.checkpoints.append(int(rec["checkpoint"]))
            self.stalls.append(float(rec["stall"]))
            if "tier_read" in rec:
                self.tier_read.append(int(rec["tier_read"]))
        elif "resumed" in rec:
            self.resumed = rec
        elif rec.get("done"):
            self.done = rec
        return rec


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }


def _train_cmd(
    cfg: DemoConfig, procs: int, layout: dict[str, int], root: Path, resume: bool, extra: list[str] | None = None
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={procs}",
        "-m",
        "training.run",
        "--model",
        cfg.model,
        "--tp",
        str(layout["tp"]),
        "--dp",
        str(layout["dp"]),
        "--zero",
        str(layout["zero"]),
        "--total-steps",
        str(cfg.total_steps),
        "--save-dir",
        str(root),
        "--save-every",
        str(cfg.save_every),
    ]
    return cmd + (extra or []) + (["--resume"] if resume else [])


def _show(cmd: list[str]) -> str:
    shown = ["torchrun" if c == "torch.distributed.run" else c for c in cmd]
    if shown[:2] == [sys.executable, "-m"]:
        shown = shown[2:]
    return " ".join(shown)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc). torchrun starts its workers in sessions of their
    own, so killing torchrun's process group would leave them running."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def crash(pid: int) -> None:
    """SIGKILL a process and all its descendants, the workers first (no one gets to clean up)."""
    for p in reversed([pid, *descendants(pid)]):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _lines(proc: subprocess.Popen, deadline: float) -> Iterator[str]:
    """``proc``'s output lines as they come; TimeoutError once ``deadline`` passes, even if it prints
    nothing more (a rank stuck in a collective)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None
        if line is None:
            return
        yield line


def train(
    cfg: DemoConfig,
    procs: int,
    layout: dict[str, int],
    root: Path,
    *,
    resume: bool,
    kill_after: int | None,
    say: Say,
    extra: list[str] | None = None,
) -> RunLog:
    """Run training under torchrun, echoing progress; SIGKILL everything once step ``kill_after`` is logged.
    ``extra``: more ``training.run`` options."""
    cmd = _train_cmd(cfg, procs, layout, root, resume, extra)
    say(f"$ {_show(cmd)}")
    log = RunLog()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.monotonic() + cfg.timeout_s
    try:
        for line in _lines(proc, deadline):
            rec = log.take(line.rstrip("\n"))
            if rec is None:
                continue
            if "loss" in rec:
                swap = rec.get("swap")
                moved = (
                    f"; swap {swap['bytes_read'] / 1e6:.0f} MB read, {swap['bytes_written'] / 1e6:.0f} MB written"
                    if swap
                    else ""
                )
                say(f"  step {rec['step']:>3}  loss {rec['loss']:.6f}  ({rec['seconds']:.2f} s{moved})")
            elif "checkpoint" in rec and "tier_read" in rec:
                say(
                    f"  checkpoint {rec['checkpoint']}: saved in {rec['stall']:.2f} s, the optimizer state streamed "
                    f"from the swap files ({rec['tier_read'] / 1e6:.0f} MB read by rank 0)"
                )
            elif "checkpoint" in rec:
                say(
                    f"  checkpoint {rec['checkpoint']}: save() returned in {rec['stall']:.3f} s, copy and write go on "
                    "in the background"
                )
            elif "resumed" in rec:
                say(f"  resumed at step {rec['resumed']} ({rec['seconds']:.2f} s to load and reshard)")
            if kill_after is not None and rec.get("step") == kill_after:
                crash(proc.pid)
                log.killed = True
                say(
                    f"  CRASH: SIGKILL to torchrun and all {procs} ranks after step {kill_after} "
                    "(a checkpoint still being written is lost; the previous one must do)"
                )
                break
    except TimeoutError:
        crash(proc.pid)
        raise TimeoutError(f"training did not finish within {cfg.timeout_s:.0f} s") from None
    finally:
        if proc.poll() is None and not log.killed:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                crash(proc.pid)
        if log.killed:
            proc.wait()
    if not log.killed and proc.returncode != 0:
        tail = "\n".join(log.output[-30:])
        raise RuntimeError(f"training exited with {proc.returncode}:\n{tail}")
    return log


def ucp_cli(args: list[str], say: Say) -> dict[str, Any]:
    """Run ``ucp ARGS --json`` as a user would; its JSON report."""
    cmd = [sys.executable, "-m", "ucp.cli", *args, "--json"]
    say(f"$ ucp {' '.join(args)}")
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ucp {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return json.loads(res.stdout)


def step_times(log: RunLog) -> dict[str, Any]:
    """Median step times, the steps right after a checkpoint apart: checkpoint N is saved after step N - 1,
    and step N runs while its copy and write go on in the background, so that is where a checkpoint's cost
    shows beyond the ``save()`` stall."""
    after = sorted(s for s in log.checkpoints if s in log.step_seconds)
    other = [t for s, t in log.step_seconds.items() if s not in after]
    return {
        "median_step_s": statistics.median(log.step_seconds.values()),
        "after_checkpoint_steps": after,
        "median_after_checkpoint_step_s": statistics.median(log.step_seconds[s] for s in after) if after else None,
        "median_other_step_s": statistics.median(other) if other else None,
    }


def offload_leg(cfg: DemoConfig, work: Path, reference: dict[int, float], say: Say) -> dict[str, Any]:
    """Step 5: the first steps again with the optimizer state on NVMe (swap files under ``work/nvme``), a
    synchronous checkpoint (streamed from the swap files), a resume in new processes. The losses must be
    ``reference``'s (the first run's, same steps). Returns the leg's figures for the summary."""
    started = time.perf_counter()
    nvme, root = work / "nvme", work / "offload-checkpoints"
    nvme.mkdir(exist_ok=True)
    lay, steps = cfg.offload_layout, cfg.offload_steps
    extra = [
        "--offload-optimizer",
        "nvme",
        "--nvme-path",
        str(nvme),
        "--swap-budget",
        cfg.swap_budget,
        "--sub-group-size",
        str(cfg.sub_group_size),
        "--no-keep-resident",  # the whole state streams through the pool each step (the leg shows the swap traffic)
        "--sync-save",
    ]
    run_cfg = cfg.model_copy(update={"total_steps": steps, "save_every": steps})
    say(
        f"\n5. the optimizer state on NVMe: train '{cfg.model}' again on {cfg.offload_procs} processes (tp={lay['tp']} "
        f"dp={lay['dp']} ZeRO-{lay['zero']}), masters and Adam moments in swap files through a {cfg.swap_budget} pool; "
        "save, resume"
    )
    first = train(run_cfg, cfg.offload_procs, lay, root, resume=False, kill_after=None, say=say, extra=extra)
    resumed = train(
        run_cfg.model_copy(update={"total_steps": steps + 1}),
        cfg.offload_procs,
        lay,
        root,
        resume=True,
        kill_after=None,
        say=say,
        extra=extra,
    )
    resumed_at = int(resumed.resumed["resumed"]) if resumed.resumed else None
    if resumed_at != steps:
        raise RuntimeError(f"the offloaded run resumed at step {resumed_at}, not at its checkpoint {steps}")
    losses = {**first.losses, **resumed.losses}
    same = sorted(set(losses) & set(reference))
    worst = max((abs(losses[s] - reference[s]) / abs(reference[s]) for s in same), default=0.0)
    say(
        "   loss with the optimizer on NVMe vs the first run, same steps: "
        + ", ".join(f"step {s}: {losses[s]:.6f} / {reference[s]:.6f}" for s in same)
    )
    if worst > 1e-5:
        raise RuntimeError(f"the offloaded run's losses differ from the first run's (max relative {worst:.2e})")
    swap = [*first.swap.values(), *resumed.swap.values()]
    if not swap or first.done is None or resumed.done is None:
        raise RuntimeError("the offloaded run reported no swap traffic")
    read, written = sum(x["bytes_read"] for x in swap), sum(x["bytes_written"] for x in swap)
    io_read, io_write = sum(x["io_read"] for x in swap), sum(x["io_write"] for x in swap)
    tier = first.done.get("offload", {})
    return {
        "processes": cfg.offload_procs,
        "layout": lay,
        "steps": sorted(losses),
        "resumed_at": resumed_at,
        "swap_budget": tier.get("budget"),
        "state_bytes_per_rank": tier.get("state_bytes"),
        "pool_bytes": tier.get("host_bytes"),
        "peak_rss": max(first.done["peak_rss"], resumed.done["peak_rss"]),  # rank 0's, the larger of the two runs
        "swap_bytes_read": read,  # rank 0's, every step
        "swap_bytes_written": written,
        "swap_read_gb_per_s": read / io_read / 1e9 if io_read else None,  # over the I/O threads' busy time
        "swap_write_gb_per_s": written / io_write / 1e9 if io_write else None,
        "median_step_s": statistics.median([*first.step_seconds.values(), *resumed.step_seconds.values()]),
        "checkpoint_tier_read": first.tier_read[0] if first.tier_read else None,
        "save_s": first.stalls[0] if first.stalls else None,
        "load_s": resumed.resumed["seconds"] if resumed.resumed else None,
        "max_relative_difference": worst,
        "seconds": time.perf_counter() - started,  # the whole leg: both runs, their start-up included
    }


class DemoSummary(BaseModel):
    workdir: str
    checkpoints: str
    first_run: dict[str, Any]
    crash: dict[str, Any]
    resume: dict[str, Any]
    continuity: dict[str, Any]
    reshape: dict[str, Any]
    export: dict[str, Any]
    offload: dict[str, Any]
    seconds: float


def run_demo(cfg: DemoConfig, say: Say) -> DemoSummary:
    started = time.perf_counter()
    import ucp

    work = Path(cfg.workdir) if cfg.workdir is not None else Path(tempfile.mkdtemp(prefix="ucp-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    root = work / "checkpoints"
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} is not empty: give a new --workdir")
    a, b = cfg.first_layout, cfg.second_layout
    say(f"work directory: {work}")

    say(
        f"\n1. train '{cfg.model}' on {cfg.first_procs} processes (tp={a['tp']} dp={a['dp']} ZeRO-{a['zero']}), "
        f"async checkpoint every {cfg.save_every} steps"
    )
    first = train(cfg, cfg.first_procs, a, root, resume=False, kill_after=cfg.kill_at, say=say)
    if not first.killed:
        raise RuntimeError("the first run ended before it could be killed; raise --steps or lower --kill-at")

    manager = ucp.CheckpointManager(root)
    infos = manager.list()
    latest = manager.latest()
    say("\n2. after the crash: " + ", ".join(f"{i.name} {i.status}" for i in infos))
    if latest is None:
        raise RuntimeError("no complete checkpoint survived the crash")
    manifest = ucp.read_manifest(manager.path(latest))
    ckpt_bytes = sum(f.size for f in manifest.files.values())

    say(f"\n3. resume on {cfg.second_procs} processes with another layout (tp={b['tp']} dp={b['dp']} ZeRO-{b['zero']})")
    second = train(cfg, cfg.second_procs, b, root, resume=True, kill_after=None, say=say)
    resumed_at = int(second.resumed["resumed"]) if second.resumed else None
    if resumed_at != latest:
        raise RuntimeError(f"resumed at step {resumed_at}, but the latest complete checkpoint is {latest}")
    overlap = sorted(set(first.losses) & set(second.losses))
    diffs = {s: abs(first.losses[s] - second.losses[s]) / abs(first.losses[s]) for s in overlap}
    worst = max(diffs.values(), default=0.0)
    say(
        "   loss before the crash vs after the resume, same steps: "
        + ", ".join(f"step {s}: {first.losses[s]:.6f} / {second.losses[s]:.6f}" for s in overlap)
    )
    if worst > 1e-5:
        raise RuntimeError(f"the resumed run's losses differ from the first run's (max relative {worst:.2e})")

    final = manager.latest()
    if final is None:
        raise RuntimeError("no complete checkpoint after the resumed run")
    src = manager.path(final)
    say(f"\n4. reshape the last checkpoint (step {final}) and export it")
    reshape = ucp_cli(["reshape", src, str(work / "consolidated")], say)
    export = ucp_cli(["export", str(work / "consolidated"), str(work / "hf"), "--format", "hf", "--dtype", "bf16"], say)
    offload = offload_leg(cfg, work, first.losses, say)

    summary = DemoSummary(
        workdir=str(work),
        checkpoints=str(root),
        first_run={
            "processes": cfg.first_procs,
            "layout": a,
            "steps_done": max(first.losses) + 1,
            **step_times(first),
            "median_save_stall_s": statistics.median(first.stalls) if first.stalls else None,
            "checkpoints": first.checkpoints,
        },
        crash={
            "after_step": cfg.kill_at,
            "listing": [{"name": i.name, "status": i.status} for i in infos],
            "latest_complete": latest,
            "checkpoint_bytes": ckpt_bytes,
        },
        resume={
            "processes": cfg.second_procs,
            "layout": b,
            "resumed_at": resumed_at,
            "load_s": second.resumed["seconds"] if second.resumed else None,
            "load_gb_per_s": ckpt_bytes / second.resumed["seconds"] / 1e9 if second.resumed else None,
            "final_step": max(second.losses) + 1,  # steps done (the engine's step count at the end)
            "last_step": max(second.losses),  # the last step as the log numbers it (from 0)
            "final_loss": second.losses[max(second.losses)],
        },
        continuity={
            "steps": overlap,
            "before": [first.losses[s] for s in overlap],
            "after": [second.losses[s] for s in overlap],
            "max_relative_difference": worst,
        },
        reshape=reshape,
        export=export,
        offload=offload,
        seconds=time.perf_counter() - started,
    )
    return summary
