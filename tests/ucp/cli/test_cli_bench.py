"""The ``ucp`` CLI skeleton and ``ucp bench io``: small sizes, real files, no timing assertions."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO
from typer.testing import CliRunner

from aio import AioHandle, libaio_status
from ucp.bench.io import NO_FIO_ENV, BenchError, BenchIoOptions, BenchIoResult, run_bench_io
from ucp.bench.raw import Dd, Fio
from ucp.bench.report import to_markdown
from ucp.cli.main import app

runner = CliRunner()
LIBAIO_OK = libaio_status()[0]


def _bench_json(args: list[str]) -> BenchIoResult:
    result = runner.invoke(app, ["bench", "io", "--json", *args])
    assert result.exit_code == 0, result.output
    return BenchIoResult.model_validate(json.loads(result.stdout))


def test_help_lists_bench_and_tune() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    assert "bench" in result.stdout and "tune" in result.stdout
    sub = runner.invoke(app, ["bench", "--help"])
    assert sub.exit_code == 0 and " io " in sub.stdout


def test_console_script_lists_commands() -> None:
    script = Path(sys.executable).with_name("ucp")
    if not script.exists():
        pytest.skip("ucp console script not installed in this environment")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "bench" in done.stdout and "tune" in done.stdout


def test_cli_and_bench_modules_import_no_torch() -> None:
    """The CLI registry, its command modules and the bench library import torch lazily, inside
    commands, so that they add nothing heavy to ``ucp --help``. The ``ucp`` package's own
    ``__init__`` is bypassed here: what it imports is not the CLI's doing."""
    root = REPO / "ucp"
    probe = (
        "import sys, types\n"
        f"pkg = types.ModuleType('ucp'); pkg.__path__ = [{str(root)!r}]; sys.modules['ucp'] = pkg\n"
        "import ucp.cli.main, ucp.cli.bench, ucp.cli.tune, ucp.bench.io, ucp.bench.report, aio.tune\n"
        "print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_bench_io_json_has_every_method_with_verified_data(tmp_path: Path) -> None:
    res = _bench_json(["--size-gib", "0.01", "--rounds", "1", "--dir", str(tmp_path)])
    expected_raw = "fio" if shutil.which("fio") else "dd"
    names = [m.name for m in res.methods]
    assert names == [expected_raw] + (["ucp-libaio"] if LIBAIO_OK else []) + ["ucp-threads", "torch", "safetensors"]
    assert res.raw_tool == expected_raw
    assert res.size_bytes == 10 * 2**20 and res.rounds == 1
    assert res.verification_passed is True
    for m in res.methods:
        assert len(m.samples) == 1
        assert m.write_gbps > 0 and m.read_gbps > 0, m.name
        # fio reports its job's CPU in percent of a runtime of a few ms here: it may round to 0.
        cpu_floor_ok = (lambda v: v >= 0) if m.kind == "raw" else (lambda v: v > 0)
        assert cpu_floor_ok(m.write_cpu_s_per_gib) and cpu_floor_ok(m.read_cpu_s_per_gib), m.name
        assert m.write_vs_raw is not None and m.write_vs_raw > 0
        assert m.read_vs_torch is not None and m.read_vs_torch > 0
        assert m.verified is (None if m.kind == "raw" else True)
    assert res.method(expected_raw).write_vs_raw == pytest.approx(1.0)  # type: ignore[union-attr]
    assert res.method("torch").read_vs_torch == pytest.approx(1.0)  # type: ignore[union-attr]
    assert [c.name for c in res.checks] == [
        "ucp_write_vs_raw",
        "ucp_read_vs_raw",
        "ucp_write_vs_torch",
        "ucp_read_vs_torch",
    ]
    assert all(isinstance(c.passed, bool) and c.method in ("ucp-libaio", "ucp-threads") for c in res.checks)
    assert isinstance(res.all_checks_passed, bool)
    assert list(tmp_path.iterdir()) == []  # every method's file was deleted


def test_bench_io_dd_fallback_when_fio_is_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_FIO_ENV, "1")
    res = _bench_json(
        ["--size-gib", "0.005", "--rounds", "2", "--dir", str(tmp_path), "--methods", "raw,threads", "--no-drop-caches"]
    )
    assert res.raw_tool == "dd"
    assert "dd fallback" in res.raw_note and NO_FIO_ENV in res.raw_note
    assert [m.name for m in res.methods] == ["dd", "ucp-threads"]
    assert all(len(m.samples) == 2 for m in res.methods)
    assert res.method("dd").write_gbps > 0 and res.method("dd").read_gbps > 0  # type: ignore[union-attr]
    # without --drop-caches only the bench's own files are evicted (cold unless they live in memory)
    assert ("evicted" in res.cold_note) is res.cold_reads and "page cache dropped" not in res.cold_note
    # torch was not run: the torch checks cannot be decided, the device checks can.
    passed = {c.name: c.passed for c in res.checks}
    assert passed["ucp_write_vs_torch"] is None and isinstance(passed["ucp_write_vs_raw"], bool)
    assert res.all_checks_passed is None


def test_bench_io_raw_dd_option_and_table_output(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["bench", "io", "--size-gib", "0.004", "--rounds", "1", "--dir", str(tmp_path), "--raw", "dd",
         "--methods", "raw,threads", "--no-drop-caches", "--block-size", "1MiB"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "dd" in result.stdout and "ucp aio threads" in result.stdout and "must hold" in result.stdout


def test_bench_rejects_unknown_method(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "io", "--size-gib", "0.004", "--dir", str(tmp_path), "--methods", "raw,nope"])
    assert result.exit_code == 2  # bad input
    assert "nope" in result.output


def test_bench_refuses_to_report_wrong_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that leaves the buffer untouched must fail the bench, not report a speed:
    the whole buffer is poisoned before every read, so stale bytes cannot pass."""
    monkeypatch.setattr(AioHandle, "read_file", lambda self, path, out=None: out)
    options = BenchIoOptions(size_gib=0.004, rounds=1, directory=tmp_path, methods=["threads"], drop_caches=False)
    with pytest.raises(
        BenchError, match=r"ucp aio threads read back wrong bytes from .*ucp-bench-ucp-threads\.bin at offset \d+"
    ):
        run_bench_io(options)
    assert list(tmp_path.iterdir()) == []


def test_markdown_report_has_table_and_command(tmp_path: Path) -> None:
    options = BenchIoOptions(
        size_gib=0.004, rounds=1, directory=tmp_path, methods=["threads", "torch"], drop_caches=False
    )
    res = run_bench_io(options, command="ucp bench io --size-gib 0.004")
    md = to_markdown(res.report())
    assert md.splitlines()[0].startswith("| method | ranks | op | GB/s | s | CPU s/GiB |")
    assert "| ucp aio threads | - | write |" in md and "| torch save/load | - | read |" in md
    assert "```\nucp bench io --size-gib 0.004\n```" in md


def test_raw_tools_move_whole_blocks_and_pass_options() -> None:
    """fio/dd only move whole blocks: the block shrinks (by halves) until it divides the size."""
    fio = Fio(3 * 2**20, 8 * 2**20, 32, iomem="shmhuge")
    cmd = fio._command("/x/f.bin", "write")
    assert "--bs=1048576" in cmd and "--iodepth=32" in cmd and "--iomem=shmhuge" in cmd and "--end_fsync=1" in cmd
    assert "--direct=1" in cmd and "--ioengine=libaio" in cmd and "--size=3145728" in cmd
    assert "--end_fsync=1" not in fio._command("/x/f.bin", "read")
    assert Dd(2**30, 8 * 2**20).block_size == 8 * 2**20
    with pytest.raises(ValueError, match="multiple of 4096"):
        Dd(5000, 8 * 2**20)


def test_report_says_when_caches_cannot_be_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import aio.tune

    monkeypatch.setattr(aio.tune, "DROP_CACHES", str(tmp_path / "no-such-dir" / "drop_caches"))
    res = run_bench_io(
        BenchIoOptions(size_gib=0.004, rounds=2, directory=tmp_path, methods=["threads"], drop_caches=True)
    )
    assert res.cold_reads is False
    assert res.cold_note.startswith("reads may be warm: cannot write") and "drop_caches" in res.cold_note
    assert "cold reads: NO" in to_markdown(res.report())
