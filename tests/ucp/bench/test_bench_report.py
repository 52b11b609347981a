"""The one bench report (ucp.bench.report.BenchReport): built by ``ucp bench io`` and ``ucp bench save``
alike, rendered by one table / markdown / JSON renderer, and carried in ``--json`` under ``report``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from ucp.bench.report import BenchReport, ReportCheck, ReportRow, print_table, source_commit, to_json, to_markdown
from ucp.cli.main import app

REPO = Path(__file__).resolve().parents[3]


def _report() -> BenchReport:
    row = dict(bytes=2 * 10**9, seconds=1.0, gbps=2.0, cpu_s_per_gib=0.5, verified=True)
    return BenchReport(
        bench="ucp bench save",
        date="2026-01-02T03:04:05+00:00",
        commit="abc123",
        command="ucp bench save --size-gib 2",
        device="fio",
        peers=["torch", "DCP"],
        rows=[
            ReportRow(name="raw", method="fio", op="save", vs_device=1.0, **row),
            ReportRow(
                name="ucp",
                method="ucp.save / ucp.load",
                ranks=2,
                op="load",
                vs_device=0.9,
                vs_peers={"torch": 1.5, "DCP": None},
                bytes_on_disk=3 << 30,
                min_gbps=1.5,
                max_gbps=2.5,
                **row,
            ),
        ],
        notes=["cold loads: yes"],
        checks=[ReportCheck(description="ucp.save beats torch", method="ucp", ratio=1.5, passed=True)],
    )


def test_markdown_table_and_json() -> None:
    report = _report()
    md = to_markdown(report)
    lines = md.splitlines()
    assert lines[0] == (
        "| method | ranks | op | GB/s (min-max) | s | CPU s/GiB | vs fio | vs torch | vs DCP | on disk | data |"
    )
    assert lines[2] == "| fio | - | save | 2.00 | 1.000 | 0.50 | 1.00x | - | - | - | ok |"
    assert (
        lines[3]
        == "| ucp.save / ucp.load | 2 | load | 2.00 (1.50-2.50) | 1.000 | 0.50 | 0.90x | 1.50x | - | 3 GiB | ok |"
    )
    assert (
        "- run 2026-01-02T03:04:05+00:00, commit abc123" in md and "  - PASS  ucp.save beats torch: 1.50x (ucp)" in md
    )
    assert md.endswith("```\nucp bench save --size-gib 2\n```\n")
    assert BenchReport.model_validate_json(to_json(report)) == report
    console = Console(record=True, width=300)
    print_table(report, console)
    text = console.export_text()
    assert "ucp bench save" in text and "2.00 (1.50-2.50)" in text and "commit abc123" in text


def test_source_commit_names_this_checkout() -> None:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    got = source_commit(REPO)
    if head.returncode != 0:
        assert got is None
    else:
        assert got is not None and got.removesuffix("+dirty") == head.stdout.strip()


def test_bench_io_json_carries_the_report(tmp_path: Path) -> None:
    args = ["bench", "io", "--size-gib", "0.004", "--rounds", "1", "--dir", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--methods", "threads,torch", "--raw", "none", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    report = BenchReport.model_validate(doc["report"])
    assert report.bench == "ucp bench io" and report.date == doc["started_at"] and report.peers == ["torch"]
    assert report.commit == doc["environment"]["commit"]
    assert [(r.name, r.op) for r in report.rows] == [
        ("ucp-threads", "write"),
        ("ucp-threads", "read"),
        ("torch", "write"),
        ("torch", "read"),
    ]
    threads = next(m for m in doc["methods"] if m["name"] == "ucp-threads")
    write = report.rows[0]
    assert write.gbps == threads["write_gbps"] and write.vs_peers == {"torch": threads["write_vs_torch"]}
    assert write.bytes == doc["size_bytes"] and write.seconds == threads["samples"][0]["write_s"]
    assert write.verified is True and report.rows[2].vs_peers == {"torch": 1.0}
