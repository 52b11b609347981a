"""The one benchmark report: what ``ucp bench io`` and ``ucp bench save`` both produce, and its renderers.

A :class:`BenchReport` is rows (one per method, world size and direction: bytes, median seconds,
GB/s, the ratio to the device limit and to the peer libraries) plus the run's metadata (date,
source commit, command), notes and the must-hold checks. Each bench keeps its own detailed result
(``BenchIoResult``, ``BenchSaveResult``: samples, environment, async stalls) and builds this
report from it with ``result.report()``; everything shown to people (the terminal table, the
markdown for docs/benchmarks.md, the ``report`` object in ``--json``) comes from here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

Op = Literal["write", "read", "save", "load"]


class ReportRow(BaseModel):
    """One method at one world size in one direction: medians over the rounds."""

    name: str = Field(description="the method's id (e.g. 'ucp', 'aio-libaio', 'raw')")
    method: str = Field(description="what the table shows (e.g. 'ucp.save / ucp.load(into=)')")
    ranks: int | None = Field(None, description="world size; None where the bench has no ranks (io, the device tool)")
    op: Op
    bytes: int = Field(description="bytes moved by one operation")
    seconds: float = Field(description="median seconds of one operation")
    gbps: float = Field(description="median 10^9 bytes/s")
    min_gbps: float | None = None
    max_gbps: float | None = None
    cpu_s_per_gib: float | None = Field(None, description="CPU seconds (user+sys) per GiB moved")
    vs_device: float | None = Field(None, description="gbps / the device limit's (fio or dd) gbps")
    vs_peers: dict[str, float | None] = Field(default_factory=dict, description="peer label -> gbps / the peer's gbps")
    bytes_on_disk: int | None = None
    verified: bool | None = Field(None, description="the data read back matched; None: not checked")


class ReportCheck(BaseModel):
    """A ratio UCP must hold; informational (the benches exit 0 either way)."""

    description: str
    method: str | None
    ratio: float | None
    passed: bool | None = Field(description="None when a method it needs was not run")


class BenchReport(BaseModel):
    bench: Literal["ucp bench io", "ucp bench save", "tools/bench_cold_load.py"]
    date: str = Field(description="when the run started (UTC, ISO 8601)")
    commit: str | None = Field(description="the source's git commit (+dirty), None outside a git checkout")
    command: str | None
    device: str | None = Field(description="the device-limit tool the vs_device ratios use (fio, dd)")
    peers: list[str] = Field(description="the vs_peers columns, in order")
    rows: list[ReportRow]
    notes: list[str] = Field(default_factory=list, description="what a reader needs to trust the numbers")
    checks: list[ReportCheck] = Field(default_factory=list)


def source_commit(path: str | Path | None = None) -> str | None:
    """The git commit of the checkout holding ``path`` (default: this package), ``+dirty`` when files
    differ from it; None when it is not a git checkout or git is missing."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where there is none): machines of one kind
    run on different CPUs, so every published figure names it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


# -- rendering ------------------------------------------------------------------------------------


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _x(x: float | None) -> str:
    return _num(x, "{:.2f}x")


def _spread(report: BenchReport) -> bool:
    return any(r.min_gbps is not None and r.max_gbps is not None for r in report.rows)


def _headers(report: BenchReport) -> list[str]:
    gbps = "GB/s (min-max)" if _spread(report) else "GB/s"
    heads = ["method", "ranks", "op", gbps, "s", "CPU s/GiB", f"vs {report.device or 'device'}"]
    heads += [f"vs {p}" for p in report.peers]
    if any(r.bytes_on_disk is not None for r in report.rows):
        heads.append("on disk")
    return [*heads, "data"]


def _row(report: BenchReport, r: ReportRow) -> list[str]:
    from aio.sizes import format_size

    rate = _num(r.gbps)
    if r.min_gbps is not None and r.max_gbps is not None:
        rate = f"{r.gbps:.2f} ({r.min_gbps:.2f}-{r.max_gbps:.2f})"
    cells = [
        r.method,
        "-" if r.ranks is None else str(r.ranks),
        r.op,
        rate,
        _num(r.seconds, "{:.3f}"),
        _num(r.cpu_s_per_gib),
        _x(r.vs_device),
    ]
    cells += [_x(r.vs_peers.get(p)) for p in report.peers]
    if any(x.bytes_on_disk is not None for x in report.rows):
        cells.append("-" if r.bytes_on_disk is None else format_size(r.bytes_on_disk))
    return [*cells, {True: "ok", False: "WRONG", None: "n/a"}[r.verified]]


def check_line(c: ReportCheck) -> str:
    mark = {True: "PASS", False: "FAIL", None: "n/a "}[c.passed]
    got = "not measured" if c.ratio is None else f"{c.ratio:.2f}x ({c.method})"
    return f"{mark}  {c.description}: {got}"


def _run_line(report: BenchReport) -> str:
    return f"run {report.date}, commit {report.commit or 'unknown'}"


def render_table(report: BenchReport) -> Any:
    """The report as rich renderables: the table, the notes and the must-hold checks."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=report.bench, title_justify="left")
    for i, h in enumerate(_headers(report)):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in report.rows:
        table.add_row(*_row(report, r))
    parts: list[Any] = [table]
    parts += [Text(line, style="dim") for line in [*report.notes, _run_line(report)]]
    parts.append(Text("must hold (informational):", style="bold"))
    for c in report.checks:
        parts.append(Text("  " + check_line(c), style={True: "green", False: "red", None: "yellow"}[c.passed]))
    return Group(*parts)


def print_table(report: BenchReport, console: Any = None) -> None:
    from rich.console import Console

    (console or Console()).print(render_table(report))


def to_markdown(report: BenchReport) -> str:
    """A markdown table, the notes, the checks and the exact command, to paste into docs/benchmarks.md."""
    headers = _headers(report)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    lines += ["| " + " | ".join(_row(report, r)) + " |" for r in report.rows]
    lines.append("")
    lines += [f"- {line}" for line in [*report.notes, _run_line(report)]]
    lines.append("- must hold (informational):")
    lines += [f"  - {check_line(c)}" for c in report.checks]
    if report.command:
        lines += ["", "Command:", "", "```", report.command, "```"]
    return "\n".join(lines) + "\n"


def to_json(report: BenchReport) -> str:
    return report.model_dump_json(indent=2)
