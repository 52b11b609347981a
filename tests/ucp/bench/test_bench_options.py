"""Edges of ``ucp bench io|save`` and tools/bench_*.py: bad arguments, clean-up, JSON, ratio math.

Argument checks (non-finite sizes, any valid aio block size, zero rounds, the memory the rank
processes cost) refuse bad runs before any work. Clean-up removes exactly what the bench made:
never a file of the user's, whatever its name, but also a missing --dir it had to create; after
Ctrl-C no child process keeps running. tools/bench_reshape.py takes paths with spaces. Tiny
sizes, one round, page cache never dropped (the machine is shared).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections import namedtuple
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import ValidationError
from repo_paths import REPO
from typer.testing import CliRunner

import ucp.bench.io as bench_io
import ucp.bench.save as bench_save
from aio import AioConfig
from aio.config import MIB
from ucp.bench.common import BenchWarning
from ucp.bench.io import BenchError, BenchIoOptions, run_bench_io
from ucp.bench.raw import Dd, Fio
from ucp.bench.report import to_markdown
from ucp.bench.save import BenchSaveOptions, OpSample, _check_resources, _raw_tool, _result, _Run
from ucp.bench.save_workers import gpt_spec
from ucp.cli.main import app

runner = CliRunner()
QUIET = ["--rounds", "1", "--no-drop-caches"]


def _tool(name: str) -> ModuleType:
    """Import tools/<name>.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_options_{name}", REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _children(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is ``pid``."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until(cond, timeout: float) -> bool:  # noqa: ANN001 - a predicate
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


# -- argument validation -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["io", "save"])
def test_infinite_size_is_a_clean_error(tmp_path: Path, kind: str) -> None:
    options = BenchIoOptions if kind == "io" else BenchSaveOptions
    with pytest.raises(ValidationError, match="size_gib"):
        options(size_gib=float("inf"))
    result = runner.invoke(app, ["bench", kind, "--size-gib", "inf", "--dir", str(tmp_path), *QUIET])
    assert result.exit_code in (1, 2) and isinstance(result.exception, SystemExit), result.exception
    assert "size" in result.output


def test_raw_tools_take_any_valid_aio_block_size(tmp_path: Path) -> None:
    for block in (3 * MIB, 12288):
        AioConfig(block_size=block)  # a valid aio config
        for tool in (Fio(10 * MIB, block, 32), Dd(10 * MIB, block)):
            assert tool.block_size % 4096 == 0 and (10 * MIB) % tool.block_size == 0 and tool.block_size <= block
    result = runner.invoke(
        app,
        [
            "bench",
            "io",
            "--size-gib",
            "0.004",
            "--dir",
            str(tmp_path),
            "--methods",
            "raw",
            "--raw",
            "dd",
            "--block-size",
            "12KiB",
            *QUIET,
        ],
    )
    assert result.exit_code == 0 or isinstance(result.exception, SystemExit), repr(result.exception)
    assert list(tmp_path.iterdir()) == []


def test_resource_check_counts_the_rank_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_save, "available_memory", lambda: 8 << 30)
    _check_resources(tmp_path, 16 * MIB, [1], 0)  # one rank of a tiny state fits in 8 GiB
    with pytest.raises(BenchError, match="memory"):
        _check_resources(tmp_path, 16 * MIB, [128], 0)


def test_more_ranks_than_cpus_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_save, "available_memory", lambda: 1 << 50)
    monkeypatch.setattr(bench_save, "_cpu_count", lambda: 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BenchWarning)
        _check_resources(tmp_path, 16 * MIB, [1, 2], 0)
    with pytest.warns(BenchWarning, match="--ranks 3 is more than the 2 CPUs"):
        _check_resources(tmp_path, 16 * MIB, [1, 3], 0)


def test_raw_tools_refuse_sizes_they_cannot_split_into_pages() -> None:
    with pytest.raises(
        ValueError, match=r"size \(10486272\) and the block size \(8388608\) must each be a positive multiple"
    ):
        Dd(10 * MIB + 512, 8 * MIB)
    with pytest.raises(ValueError, match="multiple of 4096"):
        Fio(10 * MIB, 6000, 32)
    assert Fio(10 * MIB, 8 * MIB, 32).block_size == 2 * MIB  # power-of-two blocks: as before, the largest half


@pytest.mark.parametrize("tool", ["bench_train_ckpt", "bench_reshape", "bench_convert"])
def test_tools_reject_zero_rounds_before_any_work(tool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _tool(tool)

    def no_work(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the tool started work with --rounds 0")

    if tool == "bench_train_ckpt":
        with pytest.raises(SystemExit) as info:
            module.parse_args(["--rounds", "0"])
    else:
        monkeypatch.setattr(module, "make_source" if tool == "bench_reshape" else "make_checkpoint", no_work)
        extra = ["--root", str(tmp_path)] if tool == "bench_reshape" else ["--scratch", str(tmp_path)]
        with pytest.raises(SystemExit) as info:
            module.main(["--rounds", "0", *extra])
    assert info.value.code == 2


# -- clean-up ------------------------------------------------------------------------------------


def test_bench_save_leaves_the_users_files_alone(tmp_path: Path) -> None:
    mine = {
        "m-results/table.csv": "a,b\n",
        "fio-notes.txt": "keep\n",
        "worker-setup/notes.md": "keep\n",
        "m-ucp-1r/notes.md": "the very name of the bench's ucp checkpoint dir\n",
    }
    for rel, text in mine.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    result = runner.invoke(
        app,
        [
            "bench",
            "save",
            "--size-gib",
            "0.004",
            "--ranks",
            "1",
            "--methods",
            "ucp",
            "--raw",
            "none",
            "--dir",
            str(tmp_path),
            "--json",
            *QUIET,
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["methods"] and doc["directory"] == str(tmp_path)
    for rel, text in mine.items():
        assert (tmp_path / rel).is_file() and (tmp_path / rel).read_text() == text, rel
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fio-notes.txt", "m-results", "m-ucp-1r", "worker-setup"]


def test_bench_io_leaves_the_users_files_alone(tmp_path: Path) -> None:
    mine = tmp_path / "ucp-bench-ucp-threads.bin"  # the name of the bench's own file for that method
    mine.write_text("keep\n")
    result = runner.invoke(
        app, ["bench", "io", "--size-gib", "0.004", "--methods", "threads", "--dir", str(tmp_path), "--json", *QUIET]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["directory"] == str(tmp_path)
    assert list(tmp_path.iterdir()) == [mine] and mine.read_text() == "keep\n"


def test_ranks_are_stopped_when_closing_them_is_interrupted() -> None:
    class FakeWorld:  # World's close/kill, recorded
        def __init__(self, name: str, interrupted: bool) -> None:
            self.name, self.interrupted, self.killed = name, interrupted, False

        def close(self) -> None:
            if self.interrupted:
                raise KeyboardInterrupt  # a second Ctrl-C while waiting for the ranks to quit

        def kill(self) -> None:
            self.killed = True

    worlds = [FakeWorld("1r", True), FakeWorld("2r", False)]
    with pytest.raises(KeyboardInterrupt):
        bench_save._stop_worlds(worlds)  # type: ignore[arg-type]
    assert all(w.killed for w in worlds)


@pytest.mark.parametrize("kind", ["io", "save"])
def test_a_missing_dir_is_refused_not_created(tmp_path: Path, kind: str) -> None:
    """--dir names the disk to measure: a mistyped one is bad input (exit 2), never created elsewhere."""
    target = tmp_path / "new" / "sub"
    result = runner.invoke(app, ["bench", kind, "--size-gib", "1e6", "--dir", str(target), *QUIET])
    assert result.exit_code == 2 and f"--dir {target} does not exist" in result.output
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("kind", ["io", "save"])
def test_a_bench_that_fails_leaves_its_dir_as_it_was(tmp_path: Path, kind: str) -> None:
    result = runner.invoke(app, ["bench", kind, "--size-gib", "1e6", "--dir", str(tmp_path), *QUIET])
    assert result.exit_code == 1 and "GiB free" in result.output
    assert os.listdir(tmp_path) == []


def test_bench_train_ckpt_sigint_stops_its_ranks(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tools" / "bench_train_ckpt.py"),
            "--model",
            "tiny",
            "--procs",
            "1",
            "--ways",
            "none",
            "--steps",
            "1000000",
            "--rounds",
            "1",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    ranks: list[int] = []
    try:
        assert _wait_until(lambda: bool(_children(proc.pid)), 30), "no rank started"
        ranks = _children(proc.pid)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert _wait_until(lambda: not any(_alive(r) for r in ranks), 6), f"ranks {ranks} still running"
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_bench_reshape_handles_a_root_with_spaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    import ucp

    module = _tool("bench_reshape")
    root = tmp_path / "my runs"
    src = root / "src"
    ucp.save({"w": torch.arange(8.0)}, src)
    monkeypatch.setattr(module, "make_source", lambda r, layers, vocab=None: src)
    monkeypatch.setattr(module, "drop_caches", lambda mode, s: True)  # never drop the shared page cache
    real_copy = module.copy_and_sync
    copies: list[list[str]] = []

    def copy(s: Path, d: Path) -> str:  # the cp step for real, and what it copied
        out = real_copy(s, d)
        copies.append(sorted(p.name for p in d.iterdir()))
        return out

    def run(cmd: list[str]) -> str:  # the ucp reshape steps faked
        Path(cmd[cmd.index("reshape") + 2]).mkdir(parents=True)
        return json.dumps({"peak_rss_bytes": 1})

    monkeypatch.setattr(module, "copy_and_sync", copy)
    monkeypatch.setattr(module, "_run", run)
    assert module.main(["--root", str(root), "--rounds", "1", "--drop", "data", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["median_seconds"]["cp -r + sync"] > 0
    assert copies == [sorted(p.name for p in src.iterdir())]


# -- more options, tool choice, JSON, ratios, Ctrl-C ---------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "io", "--methods", "raw,bogus"],
        ["bench", "io", "--rounds", "0"],
        ["bench", "save", "--methods", "ucp,bogus"],
        ["bench", "save", "--ranks", "0"],
        ["bench", "save", "--ranks", "1,1"],
        ["bench", "save", "--rounds", "0"],
        ["bench", "save", "--async-snapshot", "never"],
    ],
)
def test_bad_arguments_fail_before_making_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the default work dir would be made here
    result = runner.invoke(app, [*argv, "--size-gib", "0.004", "--no-drop-caches"])
    assert result.exit_code in (1, 2) and isinstance(result.exception, SystemExit), result.exception
    assert list(tmp_path.iterdir()) == []


def test_no_space_names_the_dir_and_leaves_it_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1 * MIB))
    with pytest.raises(BenchError, match=rf"{tmp_path} has 0\.00 GiB free; the bench needs about"):
        run_bench_io(BenchIoOptions(size_gib=0.004, rounds=1, directory=tmp_path, drop_caches=False))
    with pytest.raises(BenchError, match=rf"{tmp_path} has 0\.00 GiB free"):
        bench_save.run_bench_save(
            BenchSaveOptions(size_gib=0.004, rounds=1, ranks=[1], directory=tmp_path, drop_caches=False)
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off"])
def test_no_fio_env_values_that_mean_unset(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setattr(bench_save, "fio_available", lambda: True)
    monkeypatch.setenv(bench_io.NO_FIO_ENV, value)
    tool, _ = _raw_tool(BenchSaveOptions(size_gib=0.004, ranks=[1], drop_caches=False), 4 * MIB, True)
    assert isinstance(tool, Fio)


def test_fio_dd_selection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(bench_io.NO_FIO_ENV, raising=False)
    monkeypatch.setattr(bench_io, "fio_available", lambda: False)
    monkeypatch.setattr(bench_save, "fio_available", lambda: False)
    res = run_bench_io(BenchIoOptions(size_gib=0.004, rounds=1, directory=tmp_path, methods=["raw"], drop_caches=False))
    assert res.raw_tool == "dd" and "dd fallback (fio not installed)" in res.raw_note
    with pytest.raises(BenchError, match="fio requested but not installed"):
        run_bench_io(
            BenchIoOptions(size_gib=0.004, rounds=1, directory=tmp_path, methods=["raw"], raw="fio", drop_caches=False)
        )
    assert list(tmp_path.iterdir()) == []
    opts = BenchSaveOptions(size_gib=0.004, ranks=[1], drop_caches=False)
    tool, note = _raw_tool(opts, 4 * MIB, True)
    assert isinstance(tool, Dd) and "fio not installed" in note
    assert _raw_tool(opts.model_copy(update={"raw": "none"}), 4 * MIB, True) == (None, "not run")
    with pytest.raises(BenchError, match="fio requested"):
        _raw_tool(opts.model_copy(update={"raw": "fio"}), 4 * MIB, True)
    monkeypatch.setattr(bench_save, "fio_available", lambda: True)
    monkeypatch.setenv(bench_io.NO_FIO_ENV, "1")
    tool, note = _raw_tool(opts, 4 * MIB, True)
    assert isinstance(tool, Dd) and bench_io.NO_FIO_ENV in note
    assert isinstance(_raw_tool(opts.model_copy(update={"raw": "fio"}), 4 * MIB, True)[0], Fio)  # explicit wins


def test_save_ratios_with_a_method_missing_at_one_rank_count(tmp_path: Path) -> None:
    spec = gpt_spec(4 * MIB)
    nbytes = spec.state_bytes
    opts = BenchSaveOptions(size_gib=0.004, ranks=[1, 2], methods=["ucp", "torch"], drop_caches=False)
    run = _Run(opts, nbytes, None, 0)

    def s(seconds: float) -> list[OpSample]:
        return [OpSample(round=1, seconds=seconds, cpu_s=0.1)]

    run.save.update({("ucp", 1): s(1.0), ("torch", 1): s(4.0), ("ucp", 2): s(0.5)})  # torch never ran at 2 ranks
    run.load.update(
        {
            ("ucp", "full", 1): s(2.0),
            ("ucp", "into", 1): s(1.0),
            ("torch", "full", 1): s(3.0),
            ("ucp", "into", 2): s(0.25),
        }
    )
    res = _result(opts, run, spec, ([], []), None, "not run", True, {}, (False, "not run"), tmp_path, "t0", None)
    assert [(m.name, m.ranks) for m in res.methods] == [("ucp", 1), ("ucp-into", 1), ("torch", 1), ("ucp-into", 2)]
    one = res.method("ucp", 1)
    assert one.save_vs_torch == pytest.approx(4.0) and one.load_vs_torch == pytest.approx(1.5)  # type: ignore[union-attr]
    assert res.method("ucp-into", 1).load_vs_torch == pytest.approx(3.0)  # type: ignore[union-attr]
    two = res.method("ucp-into", 2)
    assert two.save_vs_torch is None and two.load_vs_torch is None and two.save_vs_raw is None  # type: ignore[union-attr]
    checks = {c.name: c for c in res.checks}
    assert checks["ucp_save_vs_torch_1r"].passed is True and checks["ucp_load_vs_torch_1r"].ratio == pytest.approx(3.0)
    assert checks["ucp_load_vs_torch_1r"].method == "ucp-into"
    assert checks["ucp_save_vs_torch_2r"].passed is None and checks["ucp_save_vs_raw_1r"].passed is None
    assert res.all_checks_passed is None
    assert "| ucp.save / ucp.load(into=) | 2 | save |" in to_markdown(res.report())


def test_bench_io_json_on_real_stdout_is_pure(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ucp.cli",
            "bench",
            "io",
            "--size-gib",
            "0.004",
            "--dir",
            str(tmp_path),
            "--methods",
            "raw,threads,torch",
            "--raw",
            "dd",
            "--json",
            *QUIET,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # nothing but the JSON object on stdout
    assert [m["name"] for m in doc["methods"]] == ["dd", "ucp-threads", "torch"]
    assert doc["methods"][1]["write_vs_raw"] == pytest.approx(
        doc["methods"][1]["write_gbps"] / doc["methods"][0]["write_gbps"]
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["io", "save"])
def test_sigint_to_the_bench_leaves_no_files_or_ranks(tmp_path: Path, kind: str) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    if kind == "io":
        args = ["io", "--size-gib", "0.02", "--rounds", "1000", "--methods", "raw,threads", "--raw", "dd"]
    else:
        args = ["save", "--size-gib", "0.01", "--rounds", "1000", "--ranks", "2", "--methods", "ucp", "--raw", "none"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ucp.cli", "bench", *args, "--no-drop-caches", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=work,
    )
    kids: list[int] = []
    try:

        def running() -> bool:
            made = [p for p in work.iterdir() if p.name.startswith(".ucp-bench")]
            prefix = "ucp-bench-" if kind == "io" else "m-"  # a method's file / checkpoint dir: mid-round
            return bool(made) and any(q.name.startswith(prefix) for q in made[0].iterdir())

        assert _wait_until(running, 60), "the bench did not start"
        kids = _children(proc.pid)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0 and out == ""
        assert list(work.iterdir()) == []  # its temp dir, files, logs and rendezvous file are gone
        assert _wait_until(lambda: not any(_alive(k) for k in kids), 10), f"left running: {kids}"
    finally:
        for pid in [proc.pid, *kids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
