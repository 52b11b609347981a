"""``ucp bench io``: how close UCP's I/O gets to the device, and how far ahead of torch.save it is.

Each round runs every method once (write, then a cold read, then delete), so a
slow phase of the disk hits all methods alike; per-method numbers are medians
over the rounds. Only one method's file exists at a time, so the bench needs
about N GiB of free space; the files live in a fresh directory under ``--dir``,
removed at the end (see :mod:`aio.workdir`).
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import resource
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, Field

from aio import AioConfig, AlignedBuffer, libaio_status
from aio.config import GIB, MIB
from aio.sizes import format_size
from aio.tune import drop_page_cache, fill_random
from aio.workdir import WorkDir
from ucp.bench.common import MAX_SIZE_GIB, NO_FIO_ENV, BenchError, evict, fio_switched_off
from ucp.bench.methods import AioMethod, Method, MethodKind, RawMethod, SafetensorsMethod, TorchMethod, versions
from ucp.bench.raw import Dd, Fio, RawRun, RawTool, direct_io_supported, fio_available
from ucp.bench.report import BenchReport, ReportCheck, ReportRow, source_commit
from ucp.errors import BenchOptionError

METHOD_CHOICES = ("raw", "libaio", "threads", "torch", "safetensors")


class BenchIoOptions(BaseModel):
    """What to measure and where."""

    size_gib: float = Field(2.0, gt=0, le=MAX_SIZE_GIB, allow_inf_nan=False, description="bytes per file, in GiB")
    rounds: int = Field(3, ge=1, description="rounds; every method runs once per round")
    directory: Path | None = Field(None, description="default: a temporary directory under the current one")
    raw: Literal["auto", "fio", "dd", "none"] = Field("auto", description="device-limit tool; auto: fio if installed")
    methods: list[str] = Field(default_factory=lambda: list(METHOD_CHOICES))
    aio: AioConfig = Field(default_factory=AioConfig, description="base config of the UCP engines")
    drop_caches: bool = Field(
        False,
        description="drop the whole system's page cache before every read (needs root); by default only the "
        "bench's own files are evicted",
    )
    fio_iomem: str = Field("malloc", description="fio --iomem (buffer memory), e.g. shmhuge")
    seed: int = 0

    @property
    def size_bytes(self) -> int:
        """Whole MiB (at least one), so every tool and dtype divides it."""
        return max(1, round(self.size_gib * GIB / MIB)) * MIB


class Sample(BaseModel):
    """One round of one method. ``*_s`` are the measured seconds (fio: its own clock)."""

    round: int
    write_s: float
    read_s: float
    write_wall_s: float
    read_wall_s: float
    write_cpu_s: float = Field(description="user+sys of this process and its children (fio: its own report)")
    read_cpu_s: float


class MethodResult(BaseModel):
    """Medians over the rounds, and ratios against the device limit and torch."""

    name: str
    label: str
    kind: MethodKind
    detail: str
    write_gbps: float = Field(description="10^9 bytes/s, fsync included")
    read_gbps: float = Field(description="10^9 bytes/s, cold")
    write_cpu_s_per_gib: float
    read_cpu_s_per_gib: float
    write_vs_raw: float | None = None
    read_vs_raw: float | None = None
    write_vs_torch: float | None = None
    read_vs_torch: float | None = None
    verified: bool | None = Field(description="every byte matched after every read; None: not checked (fio/dd data)")
    samples: list[Sample]


class Check(BaseModel):
    """A ratio UCP must hold; informational (the bench exits 0 either way)."""

    name: str
    description: str
    method: str | None = Field(description="the UCP engine with the best number in that direction")
    ratio: float | None
    threshold: float
    passed: bool | None = Field(description="None when a method it needs was not run")


class BenchIoResult(BaseModel):
    command: str | None
    started_at: str
    directory: str
    size_bytes: int
    size_gib: float
    rounds: int
    raw_tool: RawTool | None
    raw_note: str
    direct_io: bool
    cold_reads: bool
    cold_note: str
    aio_config: AioConfig
    skipped: dict[str, str] = Field(default_factory=dict, description="method -> why it did not run")
    methods: list[MethodResult]
    verification_passed: bool
    checks: list[Check]
    all_checks_passed: bool | None
    environment: dict[str, Any]
    units: dict[str, str] = Field(
        default_factory=lambda: {
            "gbps": "10^9 bytes per second (median over rounds)",
            "cpu_s_per_gib": "CPU seconds (user+sys) per GiB moved: rusage of this process and its "
            "children; fio: its job's own CPU from its JSON",
        }
    )

    def method(self, name: str) -> MethodResult | None:
        return next((m for m in self.methods if m.name == name), None)

    def report(self) -> BenchReport:
        """This run as the one report model (ucp.bench.report): a write and a read row per method."""
        rows: list[ReportRow] = []
        for m in self.methods:
            for op, gbps, cpu, vs_raw, vs_torch, seconds in (
                (
                    "write",
                    m.write_gbps,
                    m.write_cpu_s_per_gib,
                    m.write_vs_raw,
                    m.write_vs_torch,
                    [s.write_s for s in m.samples],
                ),
                (
                    "read",
                    m.read_gbps,
                    m.read_cpu_s_per_gib,
                    m.read_vs_raw,
                    m.read_vs_torch,
                    [s.read_s for s in m.samples],
                ),
            ):
                rates = [self.size_bytes / s / 1e9 for s in seconds if s > 0]
                rows.append(
                    ReportRow(
                        name=m.name,
                        method=m.label,
                        op=op,
                        bytes=self.size_bytes,
                        seconds=statistics.median(seconds) if seconds else 0.0,
                        gbps=gbps,
                        min_gbps=min(rates) if len(rates) > 1 else None,
                        max_gbps=max(rates) if len(rates) > 1 else None,
                        cpu_s_per_gib=cpu,
                        vs_device=vs_raw,
                        vs_peers={"torch": vs_torch},
                        verified=m.verified,
                    )
                )
        env = self.environment
        notes = [
            f"{format_size(self.size_bytes)} per file, {self.rounds} round(s) interleaved, medians; "
            f"dir {self.directory} ({env.get('filesystem', '?')})",
            f"device limit: {self.raw_note}",
            f"cold reads: {'yes' if self.cold_reads else 'NO'} ({self.cold_note})",
        ]
        if not self.direct_io:
            notes.append("O_DIRECT is refused on this file system: every method went through the page cache")
        notes += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        notes.append(machine_line(env))
        return BenchReport(
            bench="ucp bench io",
            date=self.started_at,
            commit=env.get("commit"),
            command=self.command,
            device=self.raw_tool,
            peers=["torch"],
            rows=rows,
            notes=notes,
            checks=[
                ReportCheck(description=c.description, method=c.method, ratio=c.ratio, passed=c.passed)
                for c in self.checks
            ],
        )


def machine_line(env: dict[str, Any]) -> str:
    """The machine and library versions of a run, for a report's notes."""
    return (
        f"machine: {env.get('cpus')} CPUs, {env.get('memory_gib')} GiB RAM, Linux {env.get('kernel')}; "
        f"python {env.get('python')}, torch {env.get('torch')}, safetensors {env.get('safetensors')}"
    )


ProgressFn = Callable[[int, int, str], None]  # (steps done, total steps, what runs next)


def run_bench_io(
    options: BenchIoOptions, *, command: str | None = None, progress: ProgressFn | None = None
) -> BenchIoResult:
    """Run the bench; raises ``BenchError`` if a method reads back wrong data."""
    unknown = sorted(set(options.methods) - set(METHOD_CHOICES))
    if unknown:
        raise BenchOptionError(f"unknown method(s) {unknown}; choose from {list(METHOD_CHOICES)}")
    nbytes = options.size_bytes
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    work = WorkDir(options.directory, ".ucp-bench-")  # every file of the run goes in here
    methods: list[Method] = []
    try:
        free = shutil.disk_usage(work.shown).free
        if free < nbytes + nbytes // 16 + 64 * MIB:
            raise BenchError(
                f"{work.shown} has {free / GIB:.2f} GiB free; the bench needs about {nbytes / GIB:.2f} GiB"
            )
        direct = direct_io_supported(work.path)
        source = AlignedBuffer(nbytes, pin=False)
        fill_random(source.numpy(), options.seed)
        skipped, raw_tool, raw_note = _build_methods(options, source, direct, methods)
        samples, cold, cold_note = _run_rounds(options, methods, work.path, progress)
    finally:
        try:
            for m in methods:
                m.close()
        finally:
            work.remove()

    results = [_summarize(m, samples[m.name], nbytes) for m in methods]
    _add_ratios(results)
    checks = _checks(results, raw_tool)
    decided = [c.passed for c in checks if c.passed is not None]
    return BenchIoResult(
        command=command,
        started_at=started,
        directory=str(work.shown),
        size_bytes=nbytes,
        size_gib=nbytes / GIB,
        rounds=options.rounds,
        raw_tool=raw_tool,
        raw_note=raw_note,
        direct_io=direct,
        cold_reads=cold,
        cold_note=cold_note,
        aio_config=options.aio,
        skipped=skipped,
        methods=results,
        verification_passed=all(r.verified is not False for r in results),
        checks=checks,
        all_checks_passed=all(decided) if len(decided) == len(checks) else None,
        environment=_environment(work.shown),
    )


def _build_methods(
    options: BenchIoOptions, source: AlignedBuffer, direct: bool, methods: list[Method]
) -> tuple[dict[str, str], RawTool | None, str]:
    """Append the selected methods to ``methods`` in a fixed order (the caller closes them even
    if a later one fails to start); say why any was left out."""
    wanted = set(options.methods)
    skipped: dict[str, str] = {}
    raw_tool: RawTool | None = None
    raw_note = "not run"
    cfg = options.aio
    if "raw" in wanted and options.raw != "none":
        tool: Fio | Dd
        no_fio = fio_switched_off()
        if options.raw == "fio" or (options.raw == "auto" and fio_available() and not no_fio):
            if not fio_available():
                raise BenchError("fio requested but not installed (apt-get install fio)")
            tool = Fio(source.nbytes, cfg.block_size, cfg.queue_depth, direct=direct, iomem=options.fio_iomem)
            raw_note = (
                f"fio, libaio engine, O_DIRECT, bs={tool.block_size}, iodepth={tool.queue_depth}, iomem={tool.iomem}"
            )
        else:
            tool = Dd(source.nbytes, cfg.block_size, direct=direct)
            why = "dd requested" if options.raw == "dd" else (f"{NO_FIO_ENV} set" if no_fio else "fio not installed")
            raw_note = (
                f"dd fallback ({why}): one request in flight, bs={tool.block_size}; a lower bound of the device limit"
            )
        if not direct:
            raw_note += "; O_DIRECT refused here, buffered"
        raw_tool = tool.name
        methods.append(RawMethod(source, tool))
    out: AlignedBuffer | None = None
    for engine in ("libaio", "threads"):
        if engine not in wanted:
            continue
        if engine == "libaio":
            ok, why = libaio_status()
            if not ok:
                skipped["ucp-libaio"] = why
                continue
        if out is None:
            out = AlignedBuffer(source.nbytes, pin=False)
        methods.append(AioMethod(source, cfg.model_copy(update={"engine": engine}), out))
    if "torch" in wanted:
        methods.append(TorchMethod(source))
    if "safetensors" in wanted:
        methods.append(SafetensorsMethod(source))
    return skipped, raw_tool, raw_note


def _file_for(workdir: Path, m: Method) -> Path:
    return workdir / f"ucp-bench-{m.name}.bin"


def _run_rounds(
    options: BenchIoOptions, methods: list[Method], workdir: Path, progress: ProgressFn | None
) -> tuple[dict[str, list[Sample]], bool, str]:
    """Round r runs every method once: write, drop caches, read, check, delete."""
    samples: dict[str, list[Sample]] = {m.name: [] for m in methods}
    cold, cold_note = True, ""
    total, step = options.rounds * len(methods) * 2, 0
    for rnd in range(1, options.rounds + 1):
        for m in methods:
            path = str(_file_for(workdir, m))
            if progress:
                progress(step, total, f"round {rnd}/{options.rounds}: {m.label} write")
            write = _timed(functools.partial(m.write, path))
            step += 1
            dropped, why = drop_page_cache() if options.drop_caches else evict(path)
            if cold:  # once it failed, keep the first reason
                cold, cold_note = dropped, why
            m.prepare_read()
            if progress:
                progress(step, total, f"round {rnd}/{options.rounds}: {m.label} read")
            read = _timed(functools.partial(m.read, path))
            step += 1
            bad = m.check()
            m.release()
            os.unlink(path)
            if bad is not None:
                raise BenchError(f"{m.label} read back wrong bytes from {path} at offset {bad} (round {rnd})")
            samples[m.name].append(
                Sample(
                    round=rnd,
                    write_s=write.seconds,
                    read_s=read.seconds,
                    write_wall_s=write.wall_s,
                    read_wall_s=read.wall_s,
                    write_cpu_s=write.cpu_s,
                    read_cpu_s=read.cpu_s,
                )
            )
    if progress:
        progress(total, total, "done")
    if not cold:
        cold_note = f"reads may be warm: {cold_note}"
    return samples, cold, cold_note


def _cpu_seconds() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class _Timing:
    seconds: float  # the measurement: the tool's own clock where it has one, else wall
    wall_s: float
    cpu_s: float


def _timed(fn: Callable[[], RawRun | None]) -> _Timing:
    """Time one call by wall clock and rusage, preferring what an external tool measured itself."""
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    tool = fn()
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    if tool is None:
        return _Timing(wall, wall, cpu)
    return _Timing(
        tool.seconds if tool.seconds is not None else wall, wall, tool.cpu_s if tool.cpu_s is not None else cpu
    )


def _summarize(m: Method, samples: list[Sample], nbytes: int) -> MethodResult:
    gib = nbytes / GIB
    return MethodResult(
        name=m.name,
        label=m.label,
        kind=m.kind,
        detail=m.detail,
        write_gbps=statistics.median(nbytes / s.write_s / 1e9 for s in samples),
        read_gbps=statistics.median(nbytes / s.read_s / 1e9 for s in samples),
        write_cpu_s_per_gib=statistics.median(s.write_cpu_s / gib for s in samples),
        read_cpu_s_per_gib=statistics.median(s.read_cpu_s / gib for s in samples),
        verified=True if m.verifies else None,  # a failed check raised BenchError before this
        samples=samples,
    )


def _add_ratios(results: list[MethodResult]) -> None:
    raw = next((r for r in results if r.kind == "raw"), None)
    torch_ = next((r for r in results if r.kind == "torch"), None)
    for r in results:
        if raw is not None:
            r.write_vs_raw = r.write_gbps / raw.write_gbps
            r.read_vs_raw = r.read_gbps / raw.read_gbps
        if torch_ is not None:
            r.write_vs_torch = r.write_gbps / torch_.write_gbps
            r.read_vs_torch = r.read_gbps / torch_.read_gbps


def _checks(results: list[MethodResult], raw_tool: RawTool | None) -> list[Check]:
    """The ratios UCP must hold, each computed with the best UCP engine for that direction."""
    ucp = [r for r in results if r.kind == "ucp"]
    raw_name = raw_tool or "fio"
    specs = [
        ("write_vs_raw", "write", f"best UCP engine write >= 0.9x {raw_name} write", 0.9),
        ("read_vs_raw", "read", f"best UCP engine read >= 0.9x {raw_name} read", 0.9),
        ("write_vs_torch", "write", "best UCP engine write >= 2x torch.save + fsync", 2.0),
        ("read_vs_torch", "read", "best UCP engine read >= 1.5x cold torch.load", 1.5),
    ]
    checks = []
    for attr, direction, text, threshold in specs:
        best = max(ucp, key=lambda r: getattr(r, f"{direction}_gbps"), default=None)
        ratio = getattr(best, attr) if best is not None else None
        checks.append(
            Check(
                name=f"ucp_{attr}",
                description=text,
                method=best.name if best is not None else None,
                ratio=ratio,
                threshold=threshold,
                passed=None if ratio is None else ratio >= threshold,
            )
        )
    return checks


def _filesystem(path: Path) -> str:
    """``"ext4 on /dev/vda"`` for the mount holding ``path`` (best effort, Linux)."""
    best, found = "", "unknown"
    target = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, found = mnt, f"{fstype} on {dev} (mounted at {mnt})"
    except OSError:
        pass
    return found


def _environment(workdir: Path) -> dict[str, Any]:
    env = versions()
    env.update(
        {
            "filesystem": _filesystem(workdir),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
            "commit": source_commit(),
        }
    )
    return env
