"""``aio.tune`` and ``ucp tune``: the search returns configs both config formats accept."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from aio import AioConfig, libaio_status
from aio.config import MIB
from aio.tune import (
    TuneGrid,
    TuneResult,
    config_from_json,
    fill_random,
    first_mismatch,
    poison,
    run_tune,
)

DS_FIELDS = ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events", "use_gds")


def _assert_roundtrip(sections: dict) -> AioConfig:
    best = AioConfig.model_validate(sections["ucp"]["aio"])
    back = AioConfig.from_deepspeed(sections["deepspeed"])  # the {"aio": {...}} shape
    for field in DS_FIELDS:
        assert getattr(back, field) == getattr(best, field), field
    assert back.to_deepspeed() == sections["deepspeed"]["aio"]
    return best


def test_run_tune_quick_grid(tmp_path: Path) -> None:
    grid = TuneGrid.quick()
    expected = list(grid.candidates())
    res = run_tune(tmp_path, size=2 * MIB + 4096 * 3, grid=grid)  # not a multiple of any block size
    engines = {"libaio", "threads"} if libaio_status()[0] else {"threads"}
    assert {t.config.engine for t in res.trials} == engines
    assert len(res.trials) == len([c for c in expected if c.engine in engines])
    assert all(t.write_gbps > 0 and t.read_gbps > 0 for t in res.trials)
    assert [t.seconds for t in res.trials] == sorted(t.seconds for t in res.trials)
    assert res.best == res.trials[0].config
    assert _assert_roundtrip(res.config_sections()) == res.best
    assert list(tmp_path.iterdir()) == []  # the test file is gone


def test_grid_skips_idle_threads_and_keeps_base_fields() -> None:
    grid = TuneGrid(engines=["threads", "libaio"], block_sizes=[MIB], queue_depths=[4, 16], thread_counts=[8])
    base = AioConfig(alignment=512, use_direct=False)
    cands = list(grid.candidates(base))
    # threads: only qd=16 (8 threads need >= 8 requests in flight); libaio: both depths.
    assert [(c.engine, c.queue_depth) for c in cands] == [("threads", 16), ("libaio", 4), ("libaio", 16)]
    assert all(c.alignment == 512 and c.use_direct is False for c in cands)


def test_cli_tune_quick_json(tmp_path: Path) -> None:
    from ucp.cli.main import app

    out_file = tmp_path / "best.json"
    work = tmp_path / "work"
    work.mkdir()  # --dir must exist: it says which disk to measure
    result = CliRunner().invoke(
        app, ["tune", "--quick", "--size-gib", "0.002", "--dir", str(work), "--json", "--output", str(out_file)]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    best = _assert_roundtrip(doc)
    tune = TuneResult.model_validate(doc["tune"])
    assert tune.best == best and tune.size_bytes == 2 * 2**30 // 1000 // 4096 * 4096
    saved = json.loads(out_file.read_text())
    assert saved == {"ucp": doc["ucp"], "deepspeed": doc["deepspeed"]}
    assert config_from_json(saved) == best  # the file feeds `ucp bench io --aio-config`


def test_cli_tune_table_output(tmp_path: Path) -> None:
    from ucp.cli.main import app

    result = CliRunner().invoke(
        app, ["tune", "--size-gib", "0.001", "--dir", str(tmp_path), "--engines", "threads", "--block-sizes", "256KiB",
              "--queue-depths", "4", "--threads", "2,4"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "threads bs=256 KiB qd=4 threads=2" in result.stdout
    assert '"intra_op_parallelism"' in result.stdout


def test_cli_tune_rejects_bad_block_size(tmp_path: Path) -> None:
    from ucp.cli.main import app

    result = CliRunner().invoke(app, ["tune", "--dir", str(tmp_path), "--block-sizes", "1000"])
    assert result.exit_code == 2  # bad input
    assert "block_size must be a positive multiple of 4096" in result.output


def test_cli_tune_reads_sizes_by_the_one_rule(tmp_path: Path) -> None:
    """``--block-sizes`` uses aio.sizes: 1MB is 10^6 bytes (not a multiple of 4096), a bare 8M is refused."""
    from ucp.cli.main import app

    result = CliRunner().invoke(app, ["tune", "--dir", str(tmp_path), "--block-sizes", "1MB"])
    assert result.exit_code != 0 and "block_size must be a positive multiple of 4096" in result.output
    result = CliRunner().invoke(app, ["tune", "--dir", str(tmp_path), "--block-sizes", "8M"])
    assert result.exit_code != 0 and "'8M' is ambiguous: write 8MB (powers of 10) or 8MiB" in result.output


def test_config_from_json_shapes() -> None:
    ds = {"aio": {"block_size": 4 * MIB, "queue_depth": 16, "intra_op_parallelism": 2}}
    assert (
        config_from_json(ds)
        == config_from_json(ds["aio"])
        == AioConfig(block_size=4 * MIB, queue_depth=16, thread_count=2)
    )
    ucp_shape = {"ucp": {"aio": {"engine": "threads", "block_size": MIB}}, "deepspeed": ds}
    assert config_from_json(ucp_shape) == AioConfig(engine="threads", block_size=MIB)


def test_fill_random_chunks_differ_and_checks_find_bad_bytes() -> None:
    a = np.empty(3 * 8 * MIB + 100, dtype=np.uint8)
    fill_random(a)
    chunk = 8 * MIB
    assert not np.array_equal(a[:chunk], a[chunk : 2 * chunk])  # nothing repeats for dedup to exploit
    assert len(np.unique(a[:4096])) > 200
    ranges = [(0, 4096), (8 * MIB + 5, 4096), (2 * chunk, 4096), (a.nbytes - 4096, 4096)]
    b = a.copy()
    assert first_mismatch(a, b, ranges) is None
    poison(b, ranges[2:3])
    assert first_mismatch(a, b, ranges) == ranges[2][0]  # ~x != x for every byte
    assert first_mismatch(a, b[:-1], ranges) == a.nbytes - 1


def test_evict_file_drops_a_files_pages_or_says_it_cannot(tmp_path) -> None:
    import os

    from aio.tune import evict_file

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    os.sync()
    assert evict_file(path) is True
    assert path.read_bytes().__len__() == 1 << 20  # still readable (from the device)
    assert evict_file(tmp_path / "missing") is False
