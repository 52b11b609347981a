"""``ucp bench save``: checkpoint save/load throughput of UCP against torch.save, safetensors, DCP and fio.

DCP runs twice: with its default FileSystemWriter/Reader (``dcp``) and with UCP's storage backend,
``ucp.dcp.Writer``/``Reader`` (``ucp-dcp``), on the same state with the same planner.

A GPT-like training state (bf16 weights, fp32 master weights, Adam moments: 14
bytes per parameter) is saved and loaded back by every method, with 1 rank and
with N ranks (real processes, gloo; see :mod:`ucp.bench.save_workers` for the
layout). Each round runs fio once (the device limit) and every method at every
rank count once, in a rotating order; loads are cold (page cache dropped first)
and checked bit-exact on sampled tensors; each method's files are deleted after
its loads, so the disk holds one checkpoint at a time (all of the run's files live in a
fresh directory under ``--dir``, removed at the end). Figures are medians over
the rounds, and every ratio compares numbers from the same run.
"""

from __future__ import annotations

import datetime as _dt
import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, Field

from aio import AioConfig
from aio.config import GIB, MIB
from aio.prefetch import available_memory
from aio.tune import drop_page_cache
from aio.workdir import WorkDir
from ucp.bench.common import MAX_SIZE_GIB, NO_FIO_ENV, BenchError, BenchWarning, evict, fio_switched_off
from ucp.bench.io import _environment, machine_line
from ucp.bench.raw import Dd, Fio, RawTool, direct_io_supported, fio_available
from ucp.bench.report import BenchReport, ReportCheck, ReportRow
from ucp.bench.save_workers import BYTES_PER_PARAM, GptSpec, WorkerConfig, gpt_spec
from ucp.errors import BenchOptionError

METHOD_CHOICES = ("raw", "ucp", "torch", "safetensors", "dcp", "ucp-dcp", "async")
MethodKind = Literal["raw", "ucp", "torch", "safetensors", "dcp", "ucp-dcp"]
CHECKPOINT_METHODS = ("ucp", "torch", "safetensors", "dcp", "ucp-dcp")  # each saved, then loaded back
ProgressFn = Callable[[int, int, str], None]

# Memory one rank process costs besides its share of the state: the interpreter with torch, gloo,
# numpy and ucp imported holds about 200 MiB of anonymous memory before it builds anything;
# rounded up, since every world's ranks live for the whole run.
RANK_PROCESS_BYTES = 256 * MIB

LABELS = {
    ("ucp", "full"): "ucp.save / ucp.load",
    ("ucp", "into"): "ucp.save / ucp.load(into=)",
    ("torch", "full"): "torch.save+fsync / torch.load",
    ("safetensors", "full"): "safetensors save_file+fsync / load_file",
    ("dcp", "in-place"): "DCP save / load (in place)",
    ("ucp-dcp", "in-place"): "DCP save / load via ucp.dcp (in place)",
}
DETAILS = {
    "ucp": "ucp.save (O_DIRECT aio, CRC-32C, atomic commit); load verifies every CRC",
    "torch": "one file per rank; torch.save + fsync, torch.load(weights_only=True, mmap=False)",
    "safetensors": "one file per rank, flat names; save_file + fsync, load_file + touching every page (it maps lazily)",
    "dcp": "torch.distributed.checkpoint FileSystemWriter/Reader defaults (thread_count=1, sync_files=True); "
    "1 rank: no_dist=True; N ranks: gloo, rank-prefixed keys",
    "ucp-dcp": "the same DCP save/load (same state, keys and planner) with storage_writer=ucp.dcp.Writer, "
    "storage_reader=ucp.dcp.Reader: a UCP checkpoint (O_DIRECT aio, CRC-32C, atomic commit); load verifies every CRC",
}


_ALL_SNAPSHOTS: list[Literal["sync", "background", "cow"]] = ["sync", "background", "cow"]


class BenchSaveOptions(BaseModel):
    size_gib: float = Field(
        2.0, gt=0, le=MAX_SIZE_GIB, allow_inf_nan=False, description="training state size (all ranks together), GiB"
    )
    rounds: int = Field(3, ge=1)
    ranks: list[int] = Field(default_factory=lambda: [1, 2], description="world sizes to measure")
    directory: Path | None = Field(None, description="default: a temporary directory under the current one")
    methods: list[str] = Field(default_factory=lambda: list(METHOD_CHOICES))
    raw: Literal["auto", "fio", "dd", "none"] = "auto"
    fio_iomem: str = "malloc"
    drop_caches: bool = False  # True: drop the whole page cache (root); False: evict the bench's own files
    aio: AioConfig = Field(default_factory=AioConfig, description="UCP's aio config; also fio's block size and depth")
    seed: int = 0
    async_snapshots: list[Literal["sync", "background", "cow"]] = Field(
        default_factory=lambda: _ALL_SNAPSHOTS.copy(),
        description="AsyncSaver snapshot modes to time: sync copies before returning; background copies while "
        "the next step computes (it waits for the copy before changing the state); cow (the default "
        "where Linux allows it) write-protects the tensors and copies them from a helper process "
        "(the step's writes wait for pages not yet copied)",
    )
    async_compute_s: float = Field(
        1.0,
        ge=0,
        description="the next training step's forward/backward, simulated by "
        "CPU matrix products between async_save and wait_snapshot: as many as take this "
        "many seconds with no save in flight",
    )
    op_timeout_s: int = Field(3600, description="a rank silent for this long during one operation fails the bench")


class OpSample(BaseModel):
    round: int
    seconds: float
    cpu_s: float = Field(description="user+sys of all ranks (fio: its own report)")


class Phase(BaseModel):
    """Medians of one direction (save or load) of one method over the rounds."""

    gbps: float = Field(description="state bytes / seconds, 10^9 bytes/s")
    min_gbps: float
    max_gbps: float
    seconds: float
    cpu_s_per_gib: float
    samples: list[OpSample]


class MethodResult(BaseModel):
    name: str
    label: str
    kind: MethodKind
    ranks: int | None = Field(description="world size; None for the device tool")
    detail: str
    save: Phase
    load: Phase
    bytes_on_disk: int | None = None
    verified: bool | None = Field(description="sampled tensors bit-exact after every load; None: not checked (fio)")
    save_vs_raw: float | None = None
    load_vs_raw: float | None = None
    save_vs_torch: float | None = None
    load_vs_torch: float | None = None
    save_vs_dcp: float | None = None
    load_vs_dcp: float | None = None


class AsyncSample(BaseModel):
    round: int
    stall_s: float = Field(
        description="time the training loop lost (slowest rank): until the save returned, plus "
        "wait_snapshot after the simulated compute, plus the step's slowdown"
    )
    waited_s: float = Field(0.0, description="the part of the stall spent in wait_snapshot (slowest rank)")
    step_slower_s: float = Field(
        0.0,
        description="the part of the stall the simulated optimizer step took longer "
        "than with no save in flight (slowest rank)",
    )
    compute_slower_s: float = Field(
        0.0,
        description="not part of the stall: how much longer the simulated compute "
        "took than with no save in flight (slowest rank)",
    )
    total_s: float = Field(description="until its result was in on every rank")


class AsyncResult(BaseModel):
    ranks: int
    snapshot: str = "sync"
    compute_s: float = 0.0
    available: bool
    note: str
    stall_s: float | None = None
    total_s: float | None = None
    sync_save_s: float | None = Field(None, description="median ucp.save time at the same ranks, same run")
    stall_vs_sync: float | None = None
    first_stall_s: float | None = Field(
        None,
        description="the untimed first save before round 1: it allocates "
        "the saver's staging memory, which later saves reuse",
    )
    verified: bool | None = None
    samples: list[AsyncSample] = []


class Check(BaseModel):
    """A ratio UCP must hold; informational (the bench exits 0 either way)."""

    name: str
    description: str
    ranks: int
    method: str | None
    ratio: float | None
    threshold: float
    at_most: bool = Field(False, description="the ratio must be <= threshold (else >=)")
    passed: bool | None


class StateInfo(BaseModel):
    bytes: int
    gib: float
    params: int
    bytes_per_param: int = BYTES_PER_PARAM
    model: GptSpec
    tensors: int
    layout: str


class BenchSaveResult(BaseModel):
    command: str | None
    started_at: str
    directory: str
    state: StateInfo
    ranks: list[int]
    rounds: int
    raw_tool: RawTool | None
    raw_note: str
    direct_io: bool
    cold_reads: bool
    cold_note: str
    aio_config: AioConfig
    skipped: dict[str, str] = Field(default_factory=dict)
    methods: list[MethodResult]
    async_save: list[AsyncResult]
    verification_passed: bool
    checks: list[Check]
    all_checks_passed: bool | None
    environment: dict[str, Any]
    units: dict[str, str] = Field(
        default_factory=lambda: {
            "gbps": "state bytes (all ranks, each byte once) / seconds, 10^9 bytes/s, median over rounds",
            "seconds": "wall clock of the whole world: barrier, operation on every rank, barrier (fsync included)",
            "cpu_s_per_gib": "CPU seconds (user+sys) of all ranks per GiB of state",
        }
    )

    def method(self, name: str, ranks: int | None) -> MethodResult | None:
        return next((m for m in self.methods if m.name == name and m.ranks == ranks), None)

    def report(self) -> BenchReport:
        """This run as the one report model (ucp.bench.report): a save and a load row per method and world size."""
        rows: list[ReportRow] = []
        for m in self.methods:
            for op, phase, vs_raw, vs_torch, vs_dcp in (
                ("save", m.save, m.save_vs_raw, m.save_vs_torch, m.save_vs_dcp),
                ("load", m.load, m.load_vs_raw, m.load_vs_torch, m.load_vs_dcp),
            ):
                rows.append(
                    ReportRow(
                        name=m.name,
                        method=m.label,
                        ranks=m.ranks,
                        op=op,
                        bytes=self.state.bytes,
                        seconds=phase.seconds,
                        gbps=phase.gbps,
                        min_gbps=phase.min_gbps if self.rounds > 1 else None,
                        max_gbps=phase.max_gbps if self.rounds > 1 else None,
                        cpu_s_per_gib=phase.cpu_s_per_gib,
                        vs_device=vs_raw,
                        vs_peers={"torch": vs_torch, "DCP": vs_dcp},
                        bytes_on_disk=m.bytes_on_disk,
                        verified=m.verified,
                    )
                )
        return BenchReport(
            bench="ucp bench save",
            date=self.started_at,
            commit=self.environment.get("commit"),
            command=self.command,
            device=self.raw_tool,
            peers=["torch", "DCP"],
            rows=rows,
            notes=[*(_async_line(a) for a in self.async_save), *notes(self), machine_line(self.environment)],
            checks=[
                ReportCheck(description=c.description, method=c.method, ratio=c.ratio, passed=c.passed)
                for c in self.checks
            ],
        )


# -- the ranks ------------------------------------------------------------------------------------


class World:
    """``size`` worker processes holding one state between them; commands go to all, replies come back."""

    def __init__(self, size: int, spec: GptSpec, options: BenchSaveOptions, workdir: Path) -> None:
        self.size = size
        self.timeout = options.op_timeout_s
        self.logs = [workdir / f"worker-{size}r-rank{r}.log" for r in range(size)]
        init = workdir / f".init-{size}r"
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        self._replies: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for r in range(size):
                cfg = WorkerConfig(
                    rank=r,
                    world=size,
                    init_file=str(init) if size > 1 else None,
                    spec=spec,
                    seed=options.seed,
                    aio_config=options.aio.model_dump(),
                )
                with open(self.logs[r], "w") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "ucp.bench.save_workers", cfg.model_dump_json()],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                        env=env,
                    )
                self.procs.append(proc)
                threading.Thread(target=self._read, args=(r, proc), daemon=True).start()
        except BaseException:
            self.kill()  # the ranks started so far: nobody else knows of them
            raise

    def _read(self, rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._replies.put((rank, line))
        self._replies.put((rank, None))

    def collect(self, what: str) -> list[dict[str, Any]]:
        """One reply from every rank; BenchError (with the rank's log) if one fails or dies."""
        import json

        replies: list[dict[str, Any] | None] = [None] * self.size
        deadline = time.monotonic() + self.timeout
        while any(r is None for r in replies):
            try:
                rank, line = self._replies.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"{self.size}-rank world: no reply to {what} within {self.timeout} s") from None
            if line is None:
                raise BenchError(f"{self.size}-rank world: rank {rank} exited during {what}{self._tail(rank)}")
            reply = json.loads(line)
            if not reply.get("ok"):
                raise BenchError(f"{self.size}-rank world: rank {rank} failed during {what}:\n{reply.get('error')}")
            replies[rank] = reply
        return replies  # type: ignore[return-value]

    def call(self, cmd: dict[str, Any], what: str) -> list[dict[str, Any]]:
        import json

        for r, proc in enumerate(self.procs):
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(cmd) + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                raise BenchError(f"{self.size}-rank world: rank {r} is gone before {what}{self._tail(r)}") from None
        return self.collect(what)

    def _tail(self, rank: int) -> str:
        try:
            text = self.logs[rank].read_text(errors="replace")[-3000:]
        except OSError:
            return ""
        return f"; its log ({self.logs[rank]}) ends:\n{text}" if text else ""

    def close(self) -> None:
        """Ask every rank to quit and wait for it (30 s at most, then kill)."""
        for proc in self.procs:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write('{"op": "quit"}\n')
                    proc.stdin.flush()
                    proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 30
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """Kill the ranks still running, at once."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


def _stop_worlds(worlds: list[World]) -> None:
    """Let every world's ranks quit; if that is interrupted (a second Ctrl-C), kill them instead."""
    try:
        for w in worlds:
            w.close()
    finally:
        for w in worlds:
            w.kill()


# -- the run --------------------------------------------------------------------------------------


def load_variants(method: str, ranks: int) -> list[str]:
    """How each method's checkpoint is read back: UCP full loads only make sense for one rank."""
    if method == "ucp":
        return ["full", "into"] if ranks == 1 else ["into"]
    return ["in-place"] if method in ("dcp", "ucp-dcp") else ["full"]


def _raw_tool(options: BenchSaveOptions, size: int, direct: bool) -> tuple[Fio | Dd | None, str]:
    """fio (or dd where fio is missing or switched off), configured as ``ucp bench io`` does."""
    if "raw" not in options.methods or options.raw == "none":
        return None, "not run"
    cfg = options.aio
    no_fio = fio_switched_off()
    if options.raw == "fio" or (options.raw == "auto" and fio_available() and not no_fio):
        if not fio_available():
            raise BenchError("fio requested but not installed (apt-get install fio)")
        tool: Fio | Dd = Fio(size, cfg.block_size, cfg.queue_depth, direct=direct, iomem=options.fio_iomem)
        note = (
            f"fio, libaio engine, O_DIRECT, bs={tool.block_size}, iodepth={cfg.queue_depth}, iomem={options.fio_iomem}"
        )
    else:
        tool = Dd(size, cfg.block_size, direct=direct)
        why = "dd requested" if options.raw == "dd" else (f"{NO_FIO_ENV} set" if no_fio else "fio not installed")
        note = f"dd fallback ({why}): one request in flight, bs={tool.block_size}; a lower bound of the device limit"
    note += f"; {size / GIB:.3f} GiB per run"
    if not direct:
        note += "; O_DIRECT refused here, buffered"
    return tool, note


def _du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


class _Run:
    """Mutable state of one bench run: samples per (method, variant, ranks), cold-read status."""

    def __init__(self, options: BenchSaveOptions, state_bytes: int, progress: ProgressFn | None, total: int) -> None:
        self.options = options
        self.state_bytes = state_bytes
        self.progress = progress
        self.total = total
        self.step = 0
        self.save: dict[tuple[str, int], list[OpSample]] = {}
        self.load: dict[tuple[str, str, int], list[OpSample]] = {}
        self.disk: dict[tuple[str, int], int] = {}
        self.asyncs: dict[tuple[int, str], list[AsyncSample]] = {}
        self.first_stall: dict[tuple[int, str], float] = {}
        self.cold = True
        self.cold_note = (
            "page cache dropped before every load"
            if options.drop_caches
            else "the bench's files evicted from the page cache before every load (--drop-caches drops it all)"
        )

    def tick(self, what: str) -> None:
        if self.progress:
            self.progress(self.step, self.total, what)
        self.step += 1

    def drop(self, path: Path) -> None:
        """Make the next read of ``path`` (a file or a checkpoint folder) cold."""
        ok, why = drop_page_cache() if self.options.drop_caches else evict(path)
        if self.cold and not ok:
            self.cold, self.cold_note = False, f"reads may be warm: {why}"


def _steps(options: BenchSaveOptions, has_raw: bool, has_async: bool) -> int:
    per_round = 2 if has_raw else 0
    for n in options.ranks:
        for m in options.methods:
            if m in CHECKPOINT_METHODS:
                per_round += 1 + len(load_variants(m, n))
            elif m == "async" and has_async:
                per_round += len(options.async_snapshots)
    return per_round * options.rounds


def run_bench_save(
    options: BenchSaveOptions, *, command: str | None = None, progress: ProgressFn | None = None
) -> BenchSaveResult:
    """Run the bench; raises BenchError if a rank fails or a method loads back wrong bytes."""
    unknown = sorted(set(options.methods) - set(METHOD_CHOICES))
    if unknown:
        raise BenchOptionError(f"unknown method(s) {unknown}; choose from {list(METHOD_CHOICES)}")
    if not options.ranks or any(n < 1 for n in options.ranks) or len(set(options.ranks)) != len(options.ranks):
        raise BenchOptionError(f"--ranks must list distinct world sizes >= 1, got {options.ranks}")
    spec = gpt_spec(round(options.size_gib * GIB))
    state_bytes = spec.state_bytes
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    work = WorkDir(options.directory, ".ucp-bench-save-")  # every file of the run goes in here
    workdir = work.path
    worlds: dict[int, World] = {}
    try:
        savers = len(options.async_snapshots) if "async" in options.methods else 0
        _check_resources(work.shown, state_bytes, options.ranks, savers)
        direct = direct_io_supported(workdir)
        # fio/dd move whole blocks: the state size rounded down to UCP's block size (< 0.5 % less
        # at 2 GiB), so that fio runs with the same request size as UCP's engine.
        bs = options.aio.block_size
        raw_size = max(bs, state_bytes // bs * bs) if state_bytes >= 8 * bs else max(MIB, state_bytes // MIB * MIB)
        tool, raw_note = _raw_tool(options, raw_size, direct)
        for n in options.ranks:  # start every world first: they build their states in parallel
            worlds[n] = World(n, spec, options, workdir)
        for n, w in worlds.items():
            w.collect(f"start-up (building the {n}-rank state)")
        skipped: dict[str, str] = {}
        has_async, async_where = False, "not run"
        if "async" in options.methods:
            found = worlds[options.ranks[0]].call({"op": "has_async"}, "has_async")[0]
            has_async, async_where = bool(found["available"]), str(found["where"])
            if not has_async:
                skipped["async"] = f"{async_where} (stall not measured)"
            elif "cow" in options.async_snapshots and found.get("no_cow"):
                skipped["async-cow"] = f"copy-on-write snapshots unavailable: {found['no_cow']}"
                options = options.model_copy(
                    update={"async_snapshots": [m for m in options.async_snapshots if m != "cow"]}
                )
        run = _Run(options, state_bytes, progress, _steps(options, tool is not None, has_async))
        raw_samples: tuple[list[OpSample], list[OpSample]] = ([], [])
        for rnd in range(1, options.rounds + 1):
            if tool is not None:
                _round_raw(run, tool, workdir, rnd, raw_samples)
            for n in options.ranks:
                methods = [m for m in options.methods if m in CHECKPOINT_METHODS]
                k = (rnd - 1) % len(methods) if methods else 0
                for m in methods[k:] + methods[:k]:  # rotate: no method always runs first
                    _round_method(run, worlds[n], m, n, workdir, rnd)
                if has_async:
                    _round_async(run, worlds[n], n, workdir, rnd)
        if progress:
            progress(run.total, run.total, "done")
    finally:
        try:
            _stop_worlds(list(worlds.values()))
        finally:
            work.remove()
    return _result(
        options,
        run,
        spec,
        raw_samples,
        tool,
        raw_note,
        direct,
        skipped,
        (has_async, async_where),
        work.shown,
        started,
        command,
    )


def _check_resources(workdir: Path, state_bytes: int, ranks: list[int], savers: int) -> None:
    """BenchError if the disk under ``workdir`` or the memory cannot hold the run; a BenchWarning
    if a world has more ranks than there are CPUs."""
    free = shutil.disk_usage(workdir).free
    need = state_bytes + state_bytes // 8 + 256 * MIB
    if free < need:
        raise BenchError(f"{workdir} has {free / GIB:.2f} GiB free; the bench needs about {need / GIB:.2f} GiB")
    # Resident: every world's state (bf16 weights replicated per rank), a staging copy of it per
    # async saver timed (each kept for reuse across rounds), plus one full load at a time, and
    # the rank processes themselves (every world's ranks are started up front and live to the end).
    bf16 = state_bytes * 2 // BYTES_PER_PARAM
    per_world = [state_bytes + (n - 1) * bf16 for n in ranks]
    resident = sum(per_world) * (1 + savers) + state_bytes + 512 * MIB + sum(ranks) * RANK_PROCESS_BYTES
    avail = available_memory()
    if avail is not None and resident > avail:
        raise BenchError(
            f"the bench needs about {resident / GIB:.1f} GiB of memory, {avail / GIB:.1f} GiB is available; "
            "use a smaller --size-gib or fewer --ranks"
        )
    cpus = _cpu_count()
    if max(ranks) > cpus:
        warnings.warn(
            f"--ranks {max(ranks)} is more than the {cpus} CPUs here: the ranks share cores, so the "
            "timings measure CPU contention as much as the storage",
            BenchWarning,
            stacklevel=2,
        )


def _cpu_count() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _round_raw(
    run: _Run, tool: Fio | Dd, workdir: Path, rnd: int, samples: tuple[list[OpSample], list[OpSample]]
) -> None:
    path = str(workdir / "fio-bench.bin")
    try:
        run.tick(f"round {rnd}/{run.options.rounds}: {tool.name} write")
        t0 = time.perf_counter()
        w = tool.write(path)
        wall = time.perf_counter() - t0
        samples[0].append(OpSample(round=rnd, seconds=w.seconds or wall, cpu_s=w.cpu_s or 0.0))
        run.drop(Path(path))
        run.tick(f"round {rnd}/{run.options.rounds}: {tool.name} read")
        t0 = time.perf_counter()
        r = tool.read(path)
        wall = time.perf_counter() - t0
        samples[1].append(OpSample(round=rnd, seconds=r.seconds or wall, cpu_s=r.cpu_s or 0.0))
    finally:
        Path(path).unlink(missing_ok=True)


def _round_method(run: _Run, world: World, method: str, n: int, workdir: Path, rnd: int) -> None:
    directory = workdir / f"m-{method}-{n}r"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    head = f"round {rnd}/{run.options.rounds}, {n} rank{'s' if n > 1 else ''}: {method}"
    try:
        run.tick(f"{head} save")
        replies = world.call({"op": "save", "method": method, "dir": str(directory)}, f"{method} save")
        run.save.setdefault((method, n), []).append(_sample(rnd, replies))
        run.disk[(method, n)] = _du(directory)
        for variant in load_variants(method, n):
            run.drop(directory)
            run.tick(f"{head} load ({variant})")
            seed = run.options.seed * 1000 + rnd
            replies = world.call(
                {"op": "load", "method": method, "variant": variant, "dir": str(directory), "seed": seed},
                f"{method} load ({variant})",
            )
            bad = [r["mismatch"] for r in replies if r.get("mismatch")]
            if bad:
                raise BenchError(
                    f"{LABELS[(method, variant)]} with {n} rank(s) loaded wrong data (round {rnd}): {bad[0]}"
                )
            run.load.setdefault((method, variant, n), []).append(_sample(rnd, replies))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _round_async(run: _Run, world: World, n: int, workdir: Path, rnd: int) -> None:
    for mode in run.options.async_snapshots:
        directory = workdir / f"m-async-{mode}-{n}r"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        try:
            run.tick(
                f"round {rnd}/{run.options.rounds}, {n} rank{'s' if n > 1 else ''}: ucp.async_save ({mode} snapshot)"
            )
            cmd = {
                "op": "async_save",
                "dir": str(directory),
                "snapshot": mode,
                "compute_s": run.options.async_compute_s,
            }
            if (n, mode) not in run.first_stall:  # a training loop saves again and again: time the steady state
                first = world.call(cmd, "ucp.async_save (first save)")
                run.first_stall[(n, mode)] = max(r["stall_s"] for r in first)
            replies = world.call(cmd, "ucp.async_save")
            bad = [r["mismatch"] for r in replies if r.get("mismatch")]
            if bad:
                raise BenchError(
                    f"ucp.async_save ({mode} snapshot) with {n} rank(s) wrote wrong data (round {rnd}): {bad[0]}"
                )
            run.asyncs.setdefault((n, mode), []).append(
                AsyncSample(
                    round=rnd,
                    stall_s=max(r["stall_s"] for r in replies),
                    waited_s=max(r["waited_s"] for r in replies),
                    step_slower_s=max(r.get("step_slower_s", 0.0) for r in replies),
                    compute_slower_s=max(r.get("compute_slower_s", 0.0) for r in replies),
                    total_s=replies[0]["seconds"],
                )
            )
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def _sample(rnd: int, replies: list[dict[str, Any]]) -> OpSample:
    return OpSample(round=rnd, seconds=replies[0]["seconds"], cpu_s=sum(r["cpu_s"] for r in replies))


# -- summarising ----------------------------------------------------------------------------------


def _phase(samples: list[OpSample], nbytes: int) -> Phase:
    rates = [nbytes / s.seconds / 1e9 for s in samples]
    return Phase(
        gbps=statistics.median(rates),
        min_gbps=min(rates),
        max_gbps=max(rates),
        seconds=statistics.median(s.seconds for s in samples),
        cpu_s_per_gib=statistics.median(s.cpu_s for s in samples) / (nbytes / GIB),
        samples=samples,
    )


def _ratio(a: Phase | None, b: Phase | None) -> float | None:
    return None if a is None or b is None else a.gbps / b.gbps


def _result(
    options: BenchSaveOptions,
    run: _Run,
    spec: GptSpec,
    raw_samples: tuple[list[OpSample], list[OpSample]],
    tool: Fio | Dd | None,
    raw_note: str,
    direct: bool,
    skipped: dict[str, str],
    found_async: tuple[bool, str],
    workdir: Path,
    started: str,
    command: str | None,
) -> BenchSaveResult:
    nbytes = spec.state_bytes
    methods: list[MethodResult] = []
    raw: MethodResult | None = None
    if tool is not None and raw_samples[0]:
        detail = tool.describe()
        raw = MethodResult(
            name=tool.name,
            label=f"{tool.name} (device limit)",
            kind="raw",
            ranks=None,
            detail=detail,
            save=_phase(raw_samples[0], tool.size),
            load=_phase(raw_samples[1], tool.size),
            verified=None,
        )
        methods.append(raw)
    for n in options.ranks:
        rows: list[MethodResult] = []
        for m in CHECKPOINT_METHODS:
            if (m, n) not in run.save:
                continue
            for variant in load_variants(m, n):
                name = m if variant in ("full", "in-place") else f"{m}-{variant}"
                rows.append(
                    MethodResult(
                        name=name,
                        label=LABELS[(m, variant)],
                        kind=m,
                        ranks=n,
                        detail=DETAILS[m],
                        save=_phase(run.save[(m, n)], nbytes),
                        load=_phase(run.load[(m, variant, n)], nbytes),
                        bytes_on_disk=run.disk.get((m, n)),
                        verified=True,
                    )
                )
        torch_ = next((r for r in rows if r.kind == "torch"), None)
        dcp = next((r for r in rows if r.kind == "dcp"), None)
        for r in rows:
            r.save_vs_raw = _ratio(r.save, raw.save if raw is not None else None)
            r.load_vs_raw = _ratio(r.load, raw.load if raw is not None else None)
            r.save_vs_torch = _ratio(r.save, torch_.save if torch_ is not None else None)
            r.load_vs_torch = _ratio(r.load, torch_.load if torch_ is not None else None)
            r.save_vs_dcp = _ratio(r.save, dcp.save if dcp is not None else None)
            r.load_vs_dcp = _ratio(r.load, dcp.load if dcp is not None else None)
        methods += rows
    asyncs = _async_results(options, run, *found_async)
    checks = _checks(methods, asyncs, options.ranks, tool.name if tool is not None else "fio")
    decided = [c.passed for c in checks if c.passed is not None]
    tensors = len(spec.param_shapes()) * 4
    return BenchSaveResult(
        command=command,
        started_at=started,
        directory=str(workdir),
        state=StateInfo(
            bytes=nbytes,
            gib=nbytes / GIB,
            params=spec.params,
            model=spec,
            tensors=tensors,
            layout="per parameter: bf16 weight (replicated on every rank, written once), fp32 master weight, "
            "Adam exp_avg and exp_avg_sq (each split in equal flat halves across ranks, ZeRO-1 style)",
        ),
        ranks=options.ranks,
        rounds=options.rounds,
        raw_tool=tool.name if tool is not None else None,
        raw_note=raw_note,
        direct_io=direct,
        cold_reads=run.cold,
        cold_note=run.cold_note,
        aio_config=options.aio,
        skipped=skipped,
        methods=methods,
        async_save=asyncs,
        verification_passed=True,
        checks=checks,
        all_checks_passed=all(decided) if decided and len(decided) == len(checks) else None,
        environment=_environment(workdir),
    )


def _async_results(options: BenchSaveOptions, run: _Run, has_async: bool, where: str) -> list[AsyncResult]:
    if "async" not in options.methods:
        return []
    out = []
    for n in options.ranks:
        sync = run.save.get(("ucp", n))
        sync_s = statistics.median(s.seconds for s in sync) if sync else None
        for mode in options.async_snapshots:
            samples = run.asyncs.get((n, mode), [])
            compute = options.async_compute_s
            if not has_async or not samples:
                out.append(
                    AsyncResult(
                        ranks=n,
                        snapshot=mode,
                        compute_s=compute,
                        available=False,
                        note=f"n/a: {where}",
                        sync_save_s=sync_s,
                    )
                )
                continue
            stall = statistics.median(s.stall_s for s in samples)
            how = (
                f"stall = until it returned + wait_snapshot after {compute:g} s of simulated compute + how much "
                "longer the next optimizer step (rewriting every saved tensor) took than with no save in flight"
            )
            out.append(
                AsyncResult(
                    ranks=n,
                    snapshot=mode,
                    compute_s=compute,
                    available=True,
                    note=f"{where}, snapshot={mode!r}; {how} (slowest rank); total = until result() on every rank",
                    stall_s=stall,
                    total_s=statistics.median(s.total_s for s in samples),
                    sync_save_s=sync_s,
                    stall_vs_sync=stall / sync_s if sync_s else None,
                    first_stall_s=run.first_stall.get((n, mode)),
                    verified=True,
                    samples=samples,
                )
            )
    return out


def _checks(methods: list[MethodResult], asyncs: list[AsyncResult], ranks: list[int], raw_name: str) -> list[Check]:
    """The issue's must-hold ratios, per world size; loads use UCP's best load variant."""
    checks = []
    for n in ranks:
        ucp_rows = [m for m in methods if m.kind == "ucp" and m.ranks == n]
        save_row = ucp_rows[0] if ucp_rows else None
        load_row = max(ucp_rows, key=lambda m: m.load.gbps, default=None)
        specs = [
            ("save_vs_raw", save_row, f"ucp.save >= 0.85x {raw_name} write", 0.85),
            ("load_vs_raw", load_row, f"ucp.load >= 0.85x {raw_name} read", 0.85),
            ("save_vs_torch", save_row, "ucp.save >= 2x torch.save + fsync", 2.0),
            ("save_vs_dcp", save_row, "ucp.save >= 1.5x DCP save", 1.5),
            ("load_vs_torch", load_row, "ucp.load >= 1.5x torch.load", 1.5),
            ("load_vs_dcp", load_row, "ucp.load >= 1.5x DCP load", 1.5),
        ]
        for attr, row, text, threshold in specs:
            ratio = getattr(row, attr) if row is not None else None
            who = None if row is None else ("ucp" if attr.startswith("save") else row.name)
            checks.append(
                Check(
                    name=f"ucp_{attr}_{n}r",
                    description=f"{text} ({n} rank{'s' if n > 1 else ''})",
                    ranks=n,
                    method=who,
                    ratio=ratio,
                    threshold=threshold,
                    passed=None if ratio is None else ratio >= threshold,
                )
            )
        backend = next((m for m in methods if m.kind == "ucp-dcp" and m.ranks == n), None)
        for op in ("save", "load") if backend is not None else ():
            ratio = getattr(backend, f"{op}_vs_dcp")
            checks.append(
                Check(
                    name=f"ucp_dcp_{op}_vs_dcp_{n}r",
                    description=f"DCP {op} via ucp.dcp >= 1.5x DCP's FileSystem{'Writer' if op == 'save' else 'Reader'} "
                    f"({n} rank{'s' if n > 1 else ''})",
                    ranks=n,
                    method="ucp-dcp",
                    ratio=ratio,
                    threshold=1.5,
                    passed=None if ratio is None else ratio >= 1.5,
                )
            )
        for a in (x for x in asyncs if x.ranks == n):
            ratio = a.stall_vs_sync
            checks.append(
                Check(
                    name=f"ucp_async_stall_{a.snapshot}_{n}r",
                    description=f"ucp.async_save stall <= 0.1x ucp.save ({n} rank{'s' if n > 1 else ''}, "
                    f"{a.snapshot} snapshot)",
                    ranks=n,
                    method="ucp-async" if a.available else None,
                    ratio=ratio,
                    threshold=0.1,
                    at_most=True,
                    passed=None if ratio is None else ratio <= 0.1,
                )
            )
    return checks


# -- the report ---------------------------------------------------------------------------------


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _async_line(a: AsyncResult) -> str:
    who = f"{a.ranks} rank{'s' if a.ranks > 1 else ''}, {a.snapshot} snapshot (next step after {a.compute_s:g} s of compute)"
    if not a.available:
        sync = f" (ucp.save took {a.sync_save_s:.2f} s)" if a.sync_save_s else ""
        return f"async save, {who}: {a.note}{sync}"
    first = "" if a.first_stall_s is None else f" (first save, allocating the staging: stall {a.first_stall_s:.2f} s)"
    step = statistics.median(x.step_slower_s for x in a.samples) if a.samples else 0.0
    compute = statistics.median(x.compute_slower_s for x in a.samples) if a.samples else 0.0
    return (
        f"async save, {who}: stall {a.stall_s:.3f} s (of it, the step slower by {step:.3f} s; the compute "
        f"meanwhile slower by {compute:.3f} s), result after {a.total_s:.2f} s; "
        f"ucp.save {_num(a.sync_save_s)} s; "
        f"stall/sync {_num(a.stall_vs_sync, '{:.3f}')}{first}"
    )


def notes(result: BenchSaveResult) -> list[str]:
    s = result.state
    m = s.model
    lines = [
        f"state: {s.gib:.2f} GiB = {s.params / 1e6:.1f} M params x {s.bytes_per_param} B (GPT d_model={m.d_model}, "
        f"{m.n_layer} layers, vocab {m.vocab}, ctx {m.n_ctx}; {s.tensors} tensors); {s.layout}",
        f"{result.rounds} round(s), methods interleaved (rotating order), medians; dir {result.directory} "
        f"({result.environment.get('filesystem', '?')})",
        f"device limit: {result.raw_note}",
        f"cold loads: {'yes' if result.cold_reads else 'NO'} ({result.cold_note})",
        "loads: sampled tensors (the largest + 4 random per rank) compared bit-exact after every load",
    ]
    if not result.direct_io:
        lines.append("O_DIRECT is refused on this file system: every method went through the page cache")
    for name, why in result.skipped.items():
        lines.append(f"skipped {name}: {why}")
    return lines
