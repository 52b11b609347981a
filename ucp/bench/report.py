"""Rendering ``BenchIoResult``: a rich table for the terminal, markdown for docs/benchmarks.md."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from aio.sizes import format_size
from ucp.bench.io import BenchIoResult, Check, MethodResult


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ratio(x: float | None) -> str:
    return _num(x, "{:.2f}x")


def _verified(m: MethodResult) -> str:
    return {True: "ok", False: "WRONG", None: "n/a"}[m.verified]


def _headers(result: BenchIoResult) -> list[str]:
    raw = result.raw_tool or "raw"
    return [
        "method",
        "write GB/s (min-max)" if result.rounds > 1 else "write GB/s",
        "read GB/s (min-max)" if result.rounds > 1 else "read GB/s",
        "write CPU s/GiB",
        "read CPU s/GiB",
        f"write vs {raw}",
        f"read vs {raw}",
        "write vs torch",
        "read vs torch",
        "data",
    ]


def _gbps(median: float, seconds: list[float], nbytes: int) -> str:
    """``median (min-max)`` over the rounds: the spread says how much to trust a ratio."""
    if len(seconds) < 2:
        return _num(median)
    rates = [nbytes / s / 1e9 for s in seconds]
    return f"{median:.2f} ({min(rates):.2f}-{max(rates):.2f})"


def _row(m: MethodResult, nbytes: int) -> list[str]:
    return [
        m.label,
        _gbps(m.write_gbps, [s.write_s for s in m.samples], nbytes),
        _gbps(m.read_gbps, [s.read_s for s in m.samples], nbytes),
        _num(m.write_cpu_s_per_gib),
        _num(m.read_cpu_s_per_gib),
        _ratio(m.write_vs_raw),
        _ratio(m.read_vs_raw),
        _ratio(m.write_vs_torch),
        _ratio(m.read_vs_torch),
        _verified(m),
    ]


def _check_line(c: Check) -> str:
    mark = {True: "PASS", False: "FAIL", None: "n/a "}[c.passed]
    got = "not measured" if c.ratio is None else f"{c.ratio:.2f}x ({c.method})"
    return f"{mark}  {c.description}: {got}"


def notes(result: BenchIoResult) -> list[str]:
    """The context a reader needs to trust the numbers."""
    lines = [
        f"{format_size(result.size_bytes)} per file, {result.rounds} round(s) interleaved, medians; "
        f"dir {result.directory} ({result.environment.get('filesystem', '?')})",
        f"device limit: {result.raw_note}",
        f"cold reads: {'yes' if result.cold_reads else 'NO'} ({result.cold_note})",
    ]
    if not result.direct_io:
        lines.append("O_DIRECT is refused on this file system: every method went through the page cache")
    for name, why in result.skipped.items():
        lines.append(f"skipped {name}: {why}")
    return lines


def render_table(result: BenchIoResult) -> Group:
    """The result as rich renderables (table, notes, must-hold checks)."""
    table = Table(title="ucp bench io", title_justify="left")
    for i, h in enumerate(_headers(result)):
        table.add_column(h, justify="left" if i == 0 else "right")
    for m in result.methods:
        table.add_row(*_row(m, result.size_bytes))
    parts: list = [table]
    parts += [Text(line, style="dim") for line in notes(result)]
    parts.append(Text("must hold (informational):", style="bold"))
    for c in result.checks:
        style = {True: "green", False: "red", None: "yellow"}[c.passed]
        parts.append(Text("  " + _check_line(c), style=style))
    return Group(*parts)


def print_table(result: BenchIoResult, console: Console | None = None) -> None:
    (console or Console()).print(render_table(result))


def to_markdown(result: BenchIoResult, command: str | None = None) -> str:
    """A markdown table plus notes and the exact command, to paste into docs/benchmarks.md."""
    headers = _headers(result)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    lines += ["| " + " | ".join(_row(m, result.size_bytes)) + " |" for m in result.methods]
    lines.append("")
    lines += [f"- {line}" for line in notes(result)]
    env = result.environment
    lines.append(
        f"- machine: {env.get('cpus')} CPUs, {env.get('memory_gib')} GiB RAM, Linux {env.get('kernel')}; "
        f"python {env.get('python')}, torch {env.get('torch')}, safetensors {env.get('safetensors')}"
    )
    lines.append("- must hold (informational):")
    lines += [f"  - {_check_line(c)}" for c in result.checks]
    cmd = command or result.command
    if cmd:
        lines += ["", "Command:", "", "```", cmd, "```"]
    return "\n".join(lines) + "\n"
