"""``ucp bench save``: a tiny run through the CLI with real rank processes; no timing assertions."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import REPO
from typer.testing import CliRunner

import ucp
from ucp.bench.report import print_table, to_markdown
from ucp.bench.save import BenchSaveResult
from ucp.bench.save_workers import (
    BYTES_PER_PARAM,
    Worker,
    WorkerConfig,
    build_state,
    find_async_save,
    get_path,
    gpt_spec,
)
from ucp.cli.main import app
from ucp.saving.cow.snapshot import cow_unavailable

runner = CliRunner()
TINY = gpt_spec(2 << 20)  # 2 MiB of state: fast in-process worker tests


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[BenchSaveResult, Path]:
    work = tmp_path_factory.mktemp("bench-save")
    result = runner.invoke(
        app,
        [
            "bench",
            "save",
            "--size-gib",
            "0.02",
            "--rounds",
            "1",
            "--ranks",
            "1,2",
            "--json",
            "--dir",
            str(work),
            "--async-compute-s",
            "0.05",
        ],
    )
    assert result.exit_code == 0, result.output
    return BenchSaveResult.model_validate(json.loads(result.stdout)), work


def test_every_method_at_both_rank_counts_with_verified_data(bench: tuple[BenchSaveResult, Path]) -> None:
    res, work = bench
    rows = [(m.name, m.ranks) for m in res.methods]
    raw = res.raw_tool
    assert raw in ("fio", "dd")
    assert rows == [
        (raw, None),
        ("ucp", 1),
        ("ucp-into", 1),
        ("torch", 1),
        ("safetensors", 1),
        ("dcp", 1),
        ("ucp-dcp", 1),
        ("ucp-into", 2),
        ("torch", 2),
        ("safetensors", 2),
        ("dcp", 2),
        ("ucp-dcp", 2),
    ]
    assert res.verification_passed and res.ranks == [1, 2] and res.rounds == 1
    for m in res.methods:
        assert m.save.gbps > 0 and m.load.gbps > 0, m.name
        assert len(m.save.samples) == 1 and len(m.load.samples) == 1
        assert m.verified is (None if m.kind == "raw" else True)
        if m.kind != "raw":
            assert m.save.cpu_s_per_gib > 0 and m.load.cpu_s_per_gib > 0
            # every method writes each byte of the state once (plus its own headers/metadata)
            assert res.state.bytes <= m.bytes_on_disk < res.state.bytes * 1.2 + (1 << 20), m.name  # type: ignore[operator]
            assert m.save_vs_raw and m.load_vs_raw and m.save_vs_torch and m.load_vs_dcp
    assert res.method("torch", 2).save_vs_torch == pytest.approx(1.0)  # type: ignore[union-attr]
    assert res.method("dcp", 1).load_vs_dcp == pytest.approx(1.0)  # type: ignore[union-attr]
    # the state asked for: 0.02 GiB of bf16 + fp32 master + Adam moments
    assert res.state.bytes == res.state.params * BYTES_PER_PARAM
    assert abs(res.state.bytes - 0.02 * 2**30) < 0.05 * 0.02 * 2**30
    assert list(work.iterdir()) == []  # checkpoints, logs and fio's file were deleted


def test_checks_and_async_are_reported(bench: tuple[BenchSaveResult, Path]) -> None:
    res, _ = bench
    names = [c.name for c in res.checks]
    for n in (1, 2):
        for what in ("save_vs_raw", "load_vs_raw", "save_vs_torch", "save_vs_dcp", "load_vs_torch", "load_vs_dcp"):
            assert f"ucp_{what}_{n}r" in names
        assert f"ucp_dcp_save_vs_dcp_{n}r" in names and f"ucp_dcp_load_vs_dcp_{n}r" in names
        assert f"ucp_async_stall_sync_{n}r" in names and f"ucp_async_stall_background_{n}r" in names
    assert all(isinstance(c.passed, bool) for c in res.checks if "async" not in c.name)
    modes = ["sync", "background"] + ([] if cow_unavailable() else ["cow"])
    assert [(a.ranks, a.snapshot) for a in res.async_save] == [(n, m) for n in (1, 2) for m in modes]
    if cow_unavailable():
        assert "async-cow" in res.skipped
    for a in res.async_save:
        assert a.compute_s == 0.05
        assert a.sync_save_s and a.sync_save_s > 0
        if find_async_save()[0] is not None:
            assert a.available and a.stall_s is not None and a.stall_vs_sync is not None and a.verified
            assert a.first_stall_s is not None and a.first_stall_s >= 0 and len(a.samples) == 1
        else:
            assert not a.available and "n/a" in a.note and "async" in res.skipped


def test_reports_render(bench: tuple[BenchSaveResult, Path]) -> None:
    res, _ = bench
    md = to_markdown(res.report())
    assert md.startswith("| method | ranks | op | GB/s | s | CPU s/GiB |") and "| vs torch | vs DCP | on disk |" in md
    assert "| ucp.save / ucp.load(into=) | 2 | save |" in md and "| DCP save / load (in place) | 1 | load |" in md
    assert "must hold" in md and "async save, 1 rank" in md
    from rich.console import Console

    console = Console(record=True, width=200)
    print_table(res.report(), console)
    text = console.export_text()
    assert "ucp bench save" in text and "vs DCP" in text and "torch.save+fsync / torch.load" in text


def test_bad_options_fail_cleanly(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["bench", "save", "--size-gib", "0.01", "--dir", str(tmp_path), "--methods", "ucp,nope"]
    )
    assert result.exit_code == 2 and "nope" in result.output
    result = runner.invoke(app, ["bench", "save", "--size-gib", "0.01", "--dir", str(tmp_path), "--ranks", "0"])
    assert result.exit_code == 2 and "ranks" in result.output
    result = runner.invoke(app, ["bench", "save", "--size-gib", "0.01", "--dir", str(tmp_path), "--ranks", "x"])
    assert result.exit_code == 2


@pytest.mark.parametrize("size", [2 << 20, 20 << 20, 2 << 30, 16 << 30])
def test_model_dims_give_the_requested_size(size: int) -> None:
    spec = gpt_spec(size)
    assert spec.d_model % 64 == 0 and 1 <= spec.n_layer <= 8 and spec.vocab >= 16
    assert abs(spec.state_bytes - size) <= spec.d_model * BYTES_PER_PARAM  # one vocab row
    shapes = spec.param_shapes()
    assert shapes["wte.weight"] == (spec.vocab, spec.d_model)
    assert shapes[f"h.{spec.n_layer - 1}.mlp.c_fc.weight"] == (4 * spec.d_model, spec.d_model)


def test_rank_states_split_the_optimizer_and_share_the_weights() -> None:
    one = build_state(TINY, 0, 1)
    halves = [build_state(TINY, r, 2) for r in range(2)]
    assert one.nbytes() == TINY.state_bytes == sum(h.nbytes() for h in halves)
    # bf16 weights equal on both ranks (replicated); each rank restores its own share of them
    w0, w1 = halves[0].ucp["model"]["wte.weight"], halves[1].ucp["model"]["wte.weight"]
    assert w0.dtype == torch.bfloat16 and torch.equal(w0.view(torch.int16), w1.view(torch.int16))
    mine = [set(h.plain["model"]) for h in halves]
    assert mine[0].isdisjoint(mine[1]) and mine[0] | mine[1] == set(one.plain["model"])
    shard = halves[1].ucp["optimizer"]["state"][0]["exp_avg"]
    assert isinstance(shard, ucp.FlatShard) and shard.start == TINY.vocab * TINY.d_model // 2
    assert shard.local.data_ptr() == halves[1].plain["optimizer"]["state"][0]["exp_avg"].data_ptr()


def _worker() -> Worker:
    return Worker(WorkerConfig(rank=0, world=1, spec=TINY))


def test_worker_round_trip_and_wrong_data_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _worker()
    for method in ("ucp", "torch", "safetensors", "dcp", "ucp-dcp") * 2:  # twice: no method may disturb the next save
        d = tmp_path / method
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        assert w.handle({"op": "save", "method": method, "dir": str(d)})["seconds"] > 0
        variants = ["full", "into"] if method == "ucp" else ["in-place"] if "dcp" in method else ["full"]
        for v in variants:
            reply = w.handle({"op": "load", "method": method, "variant": v, "dir": str(d), "seed": 3})
            assert reply["mismatch"] is None, (method, v)
    assert list(w.state.plain["optimizer"]["state"]) == list(range(len(TINY.param_shapes())))  # int keys only
    # an in-place load that does nothing must not pass: the sampled tensors were inverted first
    before = w.state.plain["model"]["wte.weight"].clone()
    monkeypatch.setattr(ucp, "load", lambda *a, **k: None)
    reply = w.handle({"op": "load", "method": "ucp", "variant": "into", "dir": str(tmp_path / "ucp"), "seed": 3})
    assert reply["mismatch"] and "differs after ucp load (into)" in reply["mismatch"]
    assert torch.equal(w.state.plain["model"]["wte.weight"].view(torch.int16), before.view(torch.int16))  # restored


def test_worker_async_save_path(tmp_path: Path) -> None:
    """The copying async path: the stall covers the call and the next step's slowdown; the data is exact."""
    w = _worker()
    assert w.handle({"op": "has_async"}) == {"available": True, "where": "ucp.async_save", "no_cow": cow_unavailable()}
    reply = w.handle({"op": "async_save", "dir": str(tmp_path), "snapshot": "sync"})
    assert reply["mismatch"] is None
    assert 0 <= reply["step_slower_s"] <= reply["stall_s"] <= reply["seconds"] and reply["compute_slower_s"] >= 0
    assert ucp.verify(tmp_path / "ckpt").ok


def test_worker_async_save_background_snapshot(tmp_path: Path) -> None:
    """A deferred snapshot: the stall is the call plus the wait after the simulated compute; the data is exact."""
    w = _worker()
    for rnd in range(2):  # the saver (and its staging) is reused across rounds
        reply = w.handle(
            {"op": "async_save", "dir": str(tmp_path / str(rnd)), "snapshot": "background", "compute_s": 0.02}
        )
        assert reply["mismatch"] is None
        assert 0 <= reply["waited_s"] <= reply["stall_s"] <= reply["seconds"]
        assert reply["seconds"] >= 0.02  # the compute ran between the call and the wait
        assert ucp.verify(tmp_path / str(rnd) / "ckpt").ok
    assert list(w._savers) == ["background"]


def test_bench_save_modules_import_no_torch() -> None:
    root = REPO / "ucp"
    probe = (
        "import sys, types\n"
        f"pkg = types.ModuleType('ucp'); pkg.__path__ = [{str(root)!r}]; sys.modules['ucp'] = pkg\n"
        "import ucp.cli.main, ucp.cli.inspect, ucp.cli.verify, ucp.bench.save, ucp.bench.save_workers\n"
        "print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_get_path_follows_int_keys() -> None:
    assert get_path({"a": {0: [5, 6]}}, ("a", 0, 1)) == 6
