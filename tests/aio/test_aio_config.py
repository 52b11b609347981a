"""AioConfig speaks DeepSpeed's `aio` section; engine="auto" prefers libaio and says why when it cannot."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

import aio.engines
from aio import AioConfig, AioHandle, LibaioEngine, ThreadEngine, create_engine, libaio_status

DS_AIO = {
    "block_size": 1048576,
    "queue_depth": 8,
    "intra_op_parallelism": 3,
    "single_submit": True,
    "overlap_events": False,
    "use_gds": False,
}


def _check_ds(cfg: AioConfig) -> None:
    assert cfg.block_size == 1 << 20
    assert cfg.queue_depth == 8
    assert cfg.thread_count == 3
    assert cfg.single_submit is True
    assert cfg.overlap_events is False
    assert cfg.use_gds is False


def test_accepts_deepspeed_aio_keys():
    _check_ds(AioConfig.model_validate(DS_AIO))
    _check_ds(AioConfig.from_deepspeed({"aio": DS_AIO}))
    _check_ds(AioConfig.from_deepspeed(DS_AIO))  # the section on its own
    _check_ds(AioConfig.from_deepspeed({"aio": DS_AIO, "train_batch_size": 8, "zero_optimization": {"stage": 3}}))
    assert AioConfig.from_deepspeed(json.loads(json.dumps({"aio": DS_AIO}))) == AioConfig.model_validate(DS_AIO)
    assert AioConfig(thread_count=5).thread_count == 5  # our own name works too


def test_to_deepspeed_round_trips():
    for cfg in (
        AioConfig(),
        AioConfig.model_validate(DS_AIO),
        AioConfig(block_size=4096, queue_depth=1, thread_count=256),
    ):
        section = cfg.to_deepspeed()
        assert set(section) == set(DS_AIO)
        assert AioConfig.from_deepspeed({"aio": json.loads(json.dumps(section))}) == cfg
    assert AioConfig.model_validate(DS_AIO).to_deepspeed() == DS_AIO


def _error_locs(exc: ValidationError) -> list[tuple]:
    return [tuple(e["loc"]) for e in exc.errors()]


def test_rejects_unknown_keys_naming_them():
    with pytest.raises(ValidationError) as info:
        AioConfig.from_deepspeed({"aio": {**DS_AIO, "blok_size": 4096}})
    assert _error_locs(info.value) == [("blok_size",)]
    assert "blok_size" in str(info.value)


@pytest.mark.parametrize("bad", [0, -4096, 1000, 4097, 3 * 4096 + 512, "big"])
def test_rejects_bad_block_sizes_naming_the_field(bad):
    with pytest.raises(ValidationError) as info:
        AioConfig.from_deepspeed({"aio": {"block_size": bad}})
    assert _error_locs(info.value) == [("block_size",)]
    assert "block_size" in str(info.value)


@pytest.mark.parametrize(
    "field,bad",
    [
        ("queue_depth", 0),
        ("queue_depth", 5000),
        ("thread_count", 0),
        ("alignment", 1000),
        ("alignment", 256),
        ("engine", "io_uring"),
    ],
)
def test_rejects_other_bad_values_naming_the_field(field, bad):
    with pytest.raises(ValidationError) as info:
        AioConfig.model_validate({field: bad})
    assert _error_locs(info.value) == [(field,)]


def test_block_size_must_be_a_multiple_of_alignment():
    with pytest.raises(ValidationError, match="block_size"):
        AioConfig(block_size=4096, alignment=8192)
    assert AioConfig(block_size=8192, alignment=8192).alignment == 8192


def test_config_is_frozen():
    with pytest.raises(ValidationError):
        AioConfig().block_size = 4096


def test_auto_picks_libaio_here():
    ok, why = libaio_status()
    if not ok:
        pytest.skip(f"libaio unavailable on this machine: {why}")
    with AioHandle(AioConfig(engine="auto")) as io:
        assert io.engine_name == "libaio"
        assert isinstance(io.engine, LibaioEngine)
    with AioHandle(AioConfig(engine="threads", thread_count=2)) as io:
        assert io.engine_name == "threads"
        assert isinstance(io.engine, ThreadEngine) and io.engine.thread_count == 2


def test_auto_falls_back_to_threads_when_libaio_is_missing(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="aio.engines")
    monkeypatch.setattr(aio.engines, "LIBAIO_ERROR", "OSError: libaio.so.1: cannot open shared object file")
    assert libaio_status()[0] is False
    engine = create_engine(AioConfig(engine="auto", thread_count=3))
    try:
        assert isinstance(engine, ThreadEngine) and engine.thread_count == 3
    finally:
        engine.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("chose threads" in m and "libaio.so.1: cannot open shared object file" in m for m in messages), messages


def test_auto_falls_back_to_threads_when_io_setup_fails(monkeypatch, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="aio.engines")
    monkeypatch.setattr(aio.engines, "libaio_status", lambda: (False, "io_setup failed: [Errno 11] EAGAIN"))
    with AioHandle(AioConfig(engine="auto")) as io:
        assert io.engine_name == "threads"
        io.write_file(tmp_path / "x.bin", b"abc")  # and it works
        assert io.read_file(tmp_path / "x.bin").view().tobytes() == b"abc"
    assert any("chose threads" in r.getMessage() and "io_setup failed" in r.getMessage() for r in caplog.records)
