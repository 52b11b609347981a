"""``ucp demo``'s summary table: the steps right after a checkpoint apart, the last step as the log
numbers it, every time in seconds."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from training.demo import DemoSummary, RunLog, step_times
from ucp.cli import demo as demo_cli


def _log(lines: list[str]) -> RunLog:
    log = RunLog()
    for line in lines:
        log.take(line)
    return log


def test_step_times_set_the_steps_after_a_checkpoint_apart() -> None:
    # checkpoint N comes after step N - 1; step N runs beside its copy and write
    log = _log(
        [
            '{"step": 0, "loss": 8.0, "seconds": 1.0}',
            '{"step": 1, "loss": 8.0, "seconds": 1.1}',
            '{"checkpoint": 2, "stall": 0.05}',
            '{"step": 2, "loss": 8.0, "seconds": 1.5}',
            '{"step": 3, "loss": 8.0, "seconds": 1.0}',
            '{"checkpoint": 4, "stall": 0.04}',
            '{"step": 4, "loss": 8.0, "seconds": 1.3}',
            '{"step": 5, "loss": 8.0, "seconds": 0.9}',
        ]
    )
    t = step_times(log)
    assert t["after_checkpoint_steps"] == [2, 4]
    assert t["median_after_checkpoint_step_s"] == pytest.approx(1.4)
    assert t["median_other_step_s"] == pytest.approx(1.0)
    assert t["median_step_s"] == pytest.approx(1.05)


def test_a_checkpoint_after_the_last_logged_step_counts_no_step() -> None:
    log = _log(['{"step": 0, "loss": 8.0, "seconds": 1.0}', '{"checkpoint": 1, "stall": 0.05}'])
    t = step_times(log)
    assert t["after_checkpoint_steps"] == [] and t["median_after_checkpoint_step_s"] is None
    assert t["median_other_step_s"] == pytest.approx(1.0)


def _summary() -> DemoSummary:
    return DemoSummary(
        workdir="/tmp/w",
        checkpoints="/tmp/w/checkpoints",
        first_run={
            "processes": 4,
            "layout": {"tp": 2, "dp": 2, "zero": 2},
            "steps_done": 11,
            "median_step_s": 1.58,
            "after_checkpoint_steps": [3, 6, 9],
            "median_after_checkpoint_step_s": 1.59,
            "median_other_step_s": 1.54,
            "median_save_stall_s": 0.132,
            "checkpoints": [3, 6, 9],
        },
        crash={
            "after_step": 10,
            "listing": [{"name": "step-00000009", "status": "complete"}],
            "latest_complete": 9,
            "checkpoint_bytes": 221_000_000,
        },
        resume={
            "processes": 2,
            "layout": {"tp": 1, "dp": 2, "zero": 3},
            "resumed_at": 9,
            "load_s": 1.71,
            "load_gb_per_s": 0.13,
            "final_step": 16,
            "last_step": 15,
            "final_loss": 8.311257,
        },
        continuity={"steps": [9, 10], "before": [8.4, 8.3], "after": [8.4, 8.3], "max_relative_difference": 0.0},
        reshape={"files": 1, "bytes_written": 221_000_000, "seconds": 3.6},
        export={"tensors": 76, "bytes": 27_600_000, "seconds": 0.99, "dst": "/tmp/w/hf"},
        offload={
            "processes": 2,
            "layout": {"tp": 1, "dp": 2, "zero": 1},
            "steps": [0, 1, 2],
            "resumed_at": 2,
            "state_bytes_per_rank": 83_000_000,
            "pool_bytes": 24_000_000,
            "peak_rss": 610_000_000,
            "swap_bytes_read": 249_000_000,
            "swap_bytes_written": 249_000_000,
            "swap_read_gb_per_s": 1.2,
            "swap_write_gb_per_s": None,
            "median_step_s": 2.5,
            "checkpoint_tier_read": 87_000_000,
            "save_s": 0.8,
            "load_s": 1.1,
            "max_relative_difference": 5.7e-8,
            "seconds": 28.0,
        },
        seconds=88.0,
    )


def test_summary_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.StringIO()
    monkeypatch.setattr(demo_cli, "out", Console(file=buf, width=400, color_system=None))
    demo_cli._print_summary(_summary())
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip() for line in buf.getvalue().splitlines() if "│" in line
    }
    assert rows["first run"] == "4 processes, tp=2 dp=2 ZeRO-2; steps 0–10, median 1.58 s per step"
    assert rows["async save stall"] == "median 0.132 s per checkpoint (8.4% of a step)"
    assert rows["steps after a checkpoint"] == (
        "median 1.59 s (steps 3, 6, 9: the copy and write run beside them) vs 1.54 s for the other steps"
    )
    assert rows["last step"] == "step 15, loss 8.311257"  # as the log numbers it, not the 16 steps done
    assert rows["optimizer on NVMe"] == (
        "2 processes, tp=1 dp=2 ZeRO-1: 83 MB of masters and moments per rank in swap files through a 24 MB pool; "
        "peak RSS 610 MB (rank 0); median 2.50 s per step"
    )
    assert rows["swap traffic"] == (
        "rank 0, steps 0–2: 0.25 GB read at 1.20 GB/s, 0.25 GB written at – (while its I/O threads were busy)"
    )
    assert rows["offloaded checkpoint"].startswith(
        "saved at step 2 in 0.80 s, streamed from the swap files (87 MB read)"
    )
    assert " ms" not in buf.getvalue()  # one unit: seconds
