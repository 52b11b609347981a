"""Edge cases of ``aio.tune`` / ``ucp tune`` and of ``ucp bench io``.

What they pin: DeepSpeed ``aio`` sections mean what they mean to DeepSpeed (its defaults, the keys
its own tuner writes); a grid without candidates, an unwritable --output, an unbounded --size-gib,
a config file that is not a JSON object or too little free space is refused up front with a
one-line error, before anything is written; block sizes larger than the test file are measured
once and never recommended; one refused cache drop marks the whole run warm; the run writes only
inside a private directory that is removed on success, failure and Ctrl-C, with any directory made
for it; and a read with a single wrong byte anywhere (or a skipped page) fails the tune and the
bench instead of being ranked. Every run is a few hundred KiB to a few MiB, and the page cache is
never really dropped (``drop_page_cache`` is replaced), so the tests are quick and leave the
machine's cache alone.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

import aio.tune as tune_mod
from aio import AioConfig, AioHandle
from aio.config import KIB, MIB
from aio.tune import TuneGrid, TuneResult, config_from_json, describe, run_tune

SMALL = 256 * KIB


def _threads_grid(**kw: Any) -> TuneGrid:
    fields: dict[str, Any] = {
        "engines": ["threads"],
        "block_sizes": [64 * KIB],
        "queue_depths": [4],
        "thread_counts": [2],
    }
    return TuneGrid(**{**fields, **kw})


@pytest.fixture(autouse=True)
def _no_real_cache_drop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never sync + drop the whole machine's page cache from a unit test (others share it)."""
    monkeypatch.setattr(tune_mod, "drop_page_cache", lambda: (True, "page cache dropped before every read"))
    import ucp.bench.io as bench_io

    monkeypatch.setattr(bench_io, "drop_page_cache", lambda: (True, "page cache dropped before every read"))


def _cli(args: list[str]):
    from ucp.cli.main import app

    return CliRunner().invoke(app, args)


def _clean_exit(result, fragment: str) -> None:
    """A CLI refusal of bad input: exit 2, a one-line ``error:`` on stderr, no Python exception escaping."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2
    assert "error:" in result.stderr and fragment in result.stderr


# -- DeepSpeed form -------------------------------------------------------------------------------


def _deepspeed_aio_constants() -> Any:
    """DeepSpeed's own aio key names and defaults (deepspeed/runtime/swap_tensor/constants.py has no
    imports, so it loads without importing the deepspeed package)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepspeed is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "runtime" / "swap_tensor" / "constants.py"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    mod_spec = importlib.util.spec_from_file_location("_ds_aio_constants", path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _deepspeed_reads(section: dict[str, Any]) -> dict[str, Any]:
    """What DeepSpeed's get_aio_config makes of an ``aio`` section: each known key, else its default."""
    c = _deepspeed_aio_constants()
    defaults = {
        c.AIO_BLOCK_SIZE: c.AIO_BLOCK_SIZE_DEFAULT,
        c.AIO_QUEUE_DEPTH: c.AIO_QUEUE_DEPTH_DEFAULT,
        c.AIO_INTRA_OP_PARALLELISM: c.AIO_INTRA_OP_PARALLELISM_DEFAULT,
        c.AIO_SINGLE_SUBMIT: c.AIO_SINGLE_SUBMIT_DEFAULT,
        c.AIO_OVERLAP_EVENTS: c.AIO_OVERLAP_EVENTS_DEFAULT,
        c.AIO_USE_GDS: c.AIO_USE_GDS_DEFAULT,
    }
    return {k: section.get(k, v) for k, v in defaults.items()}


def test_to_deepspeed_uses_exactly_deepspeeds_aio_keys() -> None:
    cfg = AioConfig(block_size=4 * MIB, queue_depth=16, thread_count=2, single_submit=True, overlap_events=False)
    ds = cfg.to_deepspeed()
    assert _deepspeed_reads(ds) == ds  # every key is one DeepSpeed reads, none missing, none extra
    assert ds["intra_op_parallelism"] == 2 and ds["single_submit"] is True and ds["overlap_events"] is False
    assert AioConfig.from_deepspeed({"train_batch_size": 8, "aio": ds}).to_deepspeed() == ds
    assert AioConfig.from_deepspeed({"thread_count": 3}).thread_count == 3  # the older key is still taken


def test_from_deepspeed_partial_section_means_what_deepspeed_reads() -> None:
    section = {"block_size": 1 * MIB, "queue_depth": 8}  # DeepSpeed: intra_op_parallelism defaults to 1
    assert AioConfig.from_deepspeed({"aio": section}).to_deepspeed() == _deepspeed_reads(section)


def test_from_deepspeed_takes_ds_nvme_tune_output() -> None:
    ds_nvme_tune = {
        "aio": {
            "single_submit": "false",
            "overlap_events": "true",
            "num_threads": 8,
            "queue_depth": 32,
            "block_size": MIB,
        }
    }
    cfg = config_from_json(ds_nvme_tune)
    assert (cfg.block_size, cfg.queue_depth, cfg.single_submit, cfg.overlap_events) == (MIB, 32, False, True)


def test_from_deepspeed_logs_what_it_ignores_and_still_refuses_typos(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="aio.config"):
        cfg = AioConfig.from_deepspeed({"num_threads": 8})
    assert cfg.thread_count == 1  # DeepSpeed reads intra_op_parallelism only: its default, 1
    assert "num_threads" in caplog.text
    with pytest.raises(ValidationError, match="blok_size"):
        AioConfig.from_deepspeed({"blok_size": MIB})


def test_flat_ucp_config_keeps_ucp_defaults() -> None:
    """A flat object naming a UCP-only field is UCP's own config; one with DeepSpeed keys only is DeepSpeed's."""
    assert config_from_json({"engine": "threads", "use_direct": False}) == AioConfig(engine="threads", use_direct=False)
    assert config_from_json({"queue_depth": 16}) == AioConfig(block_size=MIB, queue_depth=16, thread_count=1)


# -- the search ---------------------------------------------------------------------------------


def test_one_candidate_is_best_at_everything(disk_dir: Path) -> None:
    res = run_tune(disk_dir, size=SMALL, grid=_threads_grid())
    assert len(res.trials) == 1
    only = res.trials[0].config
    assert res.best == res.best_write == res.best_read == only
    assert (only.engine, only.block_size, only.queue_depth, only.thread_count) == ("threads", 64 * KIB, 4, 2)
    assert list(disk_dir.iterdir()) == []


def test_size_not_a_multiple_of_the_page_reads_back_exactly(disk_dir: Path) -> None:
    res = run_tune(disk_dir, size=3 * 4096 + 100, grid=_threads_grid(block_sizes=[4096, 8192]))
    assert len(res.trials) == 2 and list(disk_dir.iterdir()) == []


def test_empty_grid_is_refused_with_a_message(disk_dir: Path) -> None:
    with pytest.raises(ValueError, match="candidate"):
        run_tune(disk_dir, size=SMALL, grid=_threads_grid(queue_depths=[4], thread_counts=[8]))


@pytest.mark.parametrize("grid_args", [["--queue-depths", "4", "--threads", "8"], ["--queue-depths", ","]])
def test_cli_empty_grid_is_a_clean_error(tmp_path: Path, grid_args: list[str]) -> None:
    work = tmp_path / "w"
    work.mkdir()
    result = _cli(["tune", "--dir", str(work), "--size-gib", "0.0002", "--engines", "threads",
                   "--block-sizes", "64KiB", *grid_args])  # fmt: skip
    _clean_exit(result, "candidate")
    assert list(work.iterdir()) == []  # refused before anything was made


def test_ranking_ties_keep_grid_order_and_units_are_decimal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every candidate takes the same time: the order is the grid's (stable sort), and GB/s is 10^9 B/s."""
    size = 1_000_000_000 // 4096 * 4096

    def fake_measure(cfg, path, source, out):  # no I/O: fixed times
        return 0.5, 0.25, True, (True, "dropped")

    monkeypatch.setattr(tune_mod, "_measure", fake_measure)
    monkeypatch.setattr(tune_mod, "_check_free_space", lambda work, size: None)  # nothing is written
    monkeypatch.setattr(tune_mod, "AlignedBuffer", lambda n, pin=False: _FakeBuffer(n))
    monkeypatch.setattr(tune_mod, "fill_random", lambda a, seed=0: None)
    grid = TuneGrid(engines=["threads"], block_sizes=[MIB, 4 * MIB], queue_depths=[8, 32], thread_counts=[4])
    res = run_tune(tmp_path, size=size, grid=grid)
    assert [describe(t.config) for t in res.trials] == [describe(c) for c in grid.candidates()]
    assert res.best == res.best_write == res.best_read == res.trials[0].config
    t = res.trials[0]
    assert t.write_gbps == pytest.approx(size / 0.5 / 1e9) and t.read_gbps == pytest.approx(size / 0.25 / 1e9)
    assert t.seconds == pytest.approx(0.75)


class _FakeBuffer:
    def __init__(self, n: int) -> None:
        self.nbytes = n

    def numpy(self) -> np.ndarray:
        return np.zeros(0, dtype=np.uint8)


def test_block_sizes_larger_than_the_file_are_not_recommended(disk_dir: Path) -> None:
    res = run_tune(disk_dir, size=SMALL, grid=_threads_grid(block_sizes=[MIB, 16 * MIB]))
    assert res.best.block_size <= res.size_bytes


def test_block_sizes_larger_than_the_file_are_measured_once_with_a_note(tmp_path: Path) -> None:
    args = ["tune", "--dir", str(tmp_path), "--size-gib", "0.0002", "--engines", "threads",
            "--block-sizes", "64KiB,1MiB,16MiB", "--queue-depths", "4", "--threads", "2"]  # fmt: skip
    doc = json.loads(_cli(args + ["--json"]).stdout)
    res = TuneResult.model_validate(doc["tune"])
    assert [t.config.block_size for t in sorted(res.trials, key=lambda t: t.config.block_size)] == [
        64 * KIB,
        res.size_bytes,
    ]
    assert res.collapsed_block_sizes == [MIB, 16 * MIB]
    table = _cli(args)
    assert table.exit_code == 0 and "block sizes 1 MiB, 16 MiB exceed the" in table.stdout


def test_size_smaller_than_the_alignment_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smaller than one aligned block"):
        run_tune(tmp_path, size=4096, grid=_threads_grid(block_sizes=[8192]), base=AioConfig(alignment=8192))
    assert list(tmp_path.iterdir()) == []


# -- cold reads ---------------------------------------------------------------------------------


def test_drop_cache_refused_is_reported(monkeypatch: pytest.MonkeyPatch, disk_dir: Path) -> None:
    monkeypatch.setattr(tune_mod, "drop_page_cache", lambda: (False, "cannot write /proc/sys/vm/drop_caches: denied"))
    res = run_tune(disk_dir, size=SMALL, grid=_threads_grid())
    assert res.cold_reads is False and "denied" in res.cold_note


def test_one_refused_drop_makes_the_run_not_cold(monkeypatch: pytest.MonkeyPatch, disk_dir: Path) -> None:
    answers = iter([(False, "cannot write /proc/sys/vm/drop_caches: busy")])
    monkeypatch.setattr(tune_mod, "drop_page_cache", lambda: next(answers, (True, "page cache dropped")))
    res = run_tune(disk_dir, size=SMALL, grid=_threads_grid(queue_depths=[4, 8]))
    assert res.cold_reads is False and "busy" in res.cold_note


def test_cli_json_stays_pure_when_reads_are_warm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tune_mod, "drop_page_cache", lambda: (False, "cannot write /proc/sys/vm/drop_caches: denied"))
    args = ["tune", "--dir", str(tmp_path), "--size-gib", "0.0002", "--engines", "threads",
            "--block-sizes", "64KiB", "--queue-depths", "4", "--threads", "2"]  # fmt: skip
    result = _cli(args + ["--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # nothing but the JSON on stdout
    assert doc["tune"]["cold_reads"] is False
    table = _cli(args)
    assert table.exit_code == 0 and "reads may be warm" in table.stdout


# -- the files it makes -------------------------------------------------------------------------


def test_interrupt_during_a_measurement_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def interrupted(self, path, out=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(AioHandle, "read_file", interrupted)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run_tune(size=SMALL, grid=_threads_grid())  # default dir: a temp dir under the cwd
    assert list(tmp_path.iterdir()) == []


def test_interrupt_while_filling_the_source_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def interrupted(dest, seed=0):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_mod, "fill_random", interrupted)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run_tune(size=SMALL, grid=_threads_grid())
    assert list(tmp_path.iterdir()) == []


def test_existing_file_in_dir_is_not_clobbered(disk_dir: Path) -> None:
    mine = disk_dir / "ucp-tune.bin"
    mine.write_bytes(b"the user's bytes")
    run_tune(disk_dir, size=SMALL, grid=_threads_grid())
    assert mine.read_bytes() == b"the user's bytes"


def test_dir_made_for_the_run_is_removed(tmp_path: Path) -> None:
    run_tune(tmp_path / "a" / "b", size=SMALL, grid=_threads_grid())
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_writing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import shutil
    from types import SimpleNamespace

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10 * MIB, used=10 * MIB, free=0))
    with pytest.raises(RuntimeError, match="GiB free"):
        run_tune(tmp_path / "new", size=SMALL, grid=_threads_grid())
    assert list(tmp_path.iterdir()) == []


# -- CLI input and output -------------------------------------------------------------------------


def test_cli_unwritable_output_is_a_clean_error(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    result = _cli(["tune", "--dir", str(tmp_path / "w"), "--size-gib", "0.0002", "--engines", "threads",
                   "--block-sizes", "64KiB", "--queue-depths", "4", "--threads", "2",
                   "--output", str(tmp_path / "missing" / "best.json")])  # fmt: skip
    _clean_exit(result, "best.json")


def test_cli_infinite_size_is_a_clean_error(tmp_path: Path) -> None:
    _clean_exit(_cli(["tune", "--dir", str(tmp_path), "--size-gib", "inf"]), "size")


@pytest.mark.parametrize("command", [["tune"], ["bench", "io"]])
def test_cli_non_object_aio_config_is_a_clean_error(tmp_path: Path, command: list[str]) -> None:
    bad = tmp_path / "aio.json"
    bad.write_text("[]")
    _clean_exit(_cli([*command, "--dir", str(tmp_path), "--aio-config", str(bad)]), "aio.json")


def test_tune_output_feeds_bench_io(tmp_path: Path) -> None:
    """``ucp tune -o`` -> ``ucp bench io --aio-config``: the bench runs the tuned config, and the
    DeepSpeed half of the file gives the same DeepSpeed-visible fields."""
    best_file = tmp_path / "best.json"
    (tmp_path / "t").mkdir()
    (tmp_path / "b").mkdir()
    tuned = _cli(["tune", "--dir", str(tmp_path / "t"), "--size-gib", "0.0002", "--engines", "threads",
                  "--block-sizes", "64KiB,128KiB", "--queue-depths", "4", "--threads", "2", "--aio-config",
                  str(_write(tmp_path / "base.json", {"alignment": 8192, "use_direct": False})),
                  "-o", str(best_file), "--json"])  # fmt: skip
    assert tuned.exit_code == 0, tuned.output
    saved = json.loads(best_file.read_text())
    best = AioConfig.model_validate(saved["ucp"]["aio"])
    assert best.alignment == 8192 and best.use_direct is False  # the base's other fields survive
    assert TuneResult.model_validate(json.loads(tuned.stdout)["tune"]).best == best
    ds = AioConfig.from_deepspeed(saved["deepspeed"])
    assert ds.to_deepspeed() == best.to_deepspeed()
    bench = _cli(["bench", "io", "--dir", str(tmp_path / "b"), "--size-gib", "0.001", "--rounds", "1",
                  "--methods", "threads", "--raw", "none", "--no-drop-caches", "--aio-config", str(best_file),
                  "--json"])  # fmt: skip
    assert bench.exit_code == 0, bench.output
    result = json.loads(bench.stdout)
    assert AioConfig.model_validate(result["aio_config"]) == best
    assert result["methods"][0]["verified"] is True
    assert list((tmp_path / "b").iterdir()) == [] and list((tmp_path / "t").iterdir()) == []


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data))
    return path


# -- wrong reads ----------------------------------------------------------------------------------


def _offset_inside(size: int) -> int:
    """An offset far from both ends and from any page or chunk boundary: checking only the edges misses it."""
    return size // 2 + 4096 * 3 + 123


def _corrupt_reads(monkeypatch: pytest.MonkeyPatch, offset: int) -> None:
    """Make every ``read_file`` return the right bytes except one, at ``offset``."""
    real = AioHandle.read_file

    def read_file(self, path, out=None):
        buf = real(self, path, out)
        arr = buf.numpy()
        arr[offset] ^= 0xFF
        return buf

    monkeypatch.setattr(AioHandle, "read_file", read_file)


def test_tune_refuses_a_read_with_one_wrong_byte(monkeypatch: pytest.MonkeyPatch, disk_dir: Path) -> None:
    size = 4 * MIB
    bad = _offset_inside(size)
    _corrupt_reads(monkeypatch, bad)
    with pytest.raises(RuntimeError, match=f"wrong data .* at offset {bad} "):
        run_tune(disk_dir, size=size, grid=_threads_grid())
    assert list(disk_dir.iterdir()) == []


def test_bench_io_refuses_a_read_with_one_wrong_byte(monkeypatch: pytest.MonkeyPatch, disk_dir: Path) -> None:
    from ucp.bench.common import BenchError
    from ucp.bench.io import BenchIoOptions, run_bench_io

    options = BenchIoOptions(size_gib=4 / 1024, rounds=1, directory=disk_dir, raw="none", methods=["threads"],
                             drop_caches=False)  # fmt: skip
    bad = _offset_inside(options.size_bytes)
    _corrupt_reads(monkeypatch, bad)
    with pytest.raises(BenchError, match=f"wrong bytes .* at offset {bad} "):
        run_bench_io(options)


def test_tune_refuses_a_read_that_skips_a_page(monkeypatch: pytest.MonkeyPatch, disk_dir: Path) -> None:
    """From the second candidate on, one page in the middle is never read: the reused buffer still
    holds the first candidate's bytes there, which are right, so only a buffer poisoned whole fails it."""
    real, calls = AioHandle.read_file, [0]
    page = slice(_offset_inside(SMALL) // 4096 * 4096, _offset_inside(SMALL) // 4096 * 4096 + 4096)

    def read_file(self, path, out=None):
        calls[0] += 1
        before = out.numpy()[page].copy()
        buf = real(self, path, out)
        if calls[0] > 1:
            buf.numpy()[page] = before  # as if this page had been skipped
        return buf

    monkeypatch.setattr(AioHandle, "read_file", read_file)
    with pytest.raises(RuntimeError, match="wrong data"):
        run_tune(disk_dir, size=SMALL, grid=_threads_grid(queue_depths=[4, 8]))


def test_bench_io_catches_a_wrong_byte_in_the_first_page(monkeypatch: pytest.MonkeyPatch, disk_dir: Path) -> None:
    """A wrong byte near the start is caught too, and the work dir is removed."""
    from ucp.bench.common import BenchError
    from ucp.bench.io import BenchIoOptions, run_bench_io

    _corrupt_reads(monkeypatch, 10)
    options = BenchIoOptions(size_gib=1 / 1024, rounds=1, directory=disk_dir, raw="none", methods=["threads"],
                             drop_caches=False)  # fmt: skip
    with pytest.raises(BenchError, match="at offset 10"):
        run_bench_io(options)
    assert list(disk_dir.iterdir()) == []


# -- bench io report units ----------------------------------------------------------------------------


def test_bench_io_units_agree_across_json_table_and_markdown(disk_dir: Path) -> None:
    from rich.console import Console

    from ucp.bench.io import BenchIoOptions, run_bench_io
    from ucp.bench.report import print_table, to_markdown

    options = BenchIoOptions(size_gib=1 / 1024, rounds=2, directory=disk_dir, raw="none", methods=["threads"],
                             drop_caches=True)  # fmt: skip
    res = run_bench_io(options)
    m = res.methods[0]
    rates = sorted(res.size_bytes / s.write_s / 1e9 for s in m.samples)
    assert m.write_gbps == pytest.approx(sum(rates) / 2)  # median of two rounds, 10^9 B/s
    cpu = [s.write_cpu_s * 2**30 / res.size_bytes for s in m.samples]
    assert m.write_cpu_s_per_gib == pytest.approx(sum(cpu) / 2)  # CPU s per GiB (2^30 B)
    cell = f"{m.write_gbps:.2f} ({rates[0]:.2f}-{rates[1]:.2f})"
    md = to_markdown(res.report())
    assert cell in md and "GB/s (min-max)" in md and "1 MiB per file" in md
    console = Console(width=400, record=True)
    print_table(res.report(), console)
    assert cell in console.export_text()
    assert res.units["gbps"].startswith("10^9 bytes")
    assert res.cold_reads is True and m.verified is True
