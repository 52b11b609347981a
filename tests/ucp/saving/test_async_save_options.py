"""AsyncSaveOptions: the asynchronous saver's options in one model, each default defined once, and the snapshot
mode chosen once from them."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import ucp
from ucp.manager import CheckpointManager
from ucp.saving import snapshot_modes
from ucp.saving.async_save import AsyncSaver
from ucp.saving.background.job import WriteJob
from ucp.saving.options import AsyncSaveOptions

FIELDS = set(AsyncSaveOptions.model_fields)


def test_no_caller_writes_a_default_of_its_own() -> None:
    """Every option AsyncSaver and CheckpointManager accept defaults to None: "take AsyncSaveOptions' default"."""
    for fn in (AsyncSaver.__init__, CheckpointManager.__init__):
        params = inspect.signature(fn).parameters
        for name in FIELDS & set(params):
            assert params[name].default is None, f"{fn.__qualname__}({name}=...) restates a default"
    assert WriteJob.model_fields["commit_timeout"].default == AsyncSaveOptions().commit_timeout


def test_a_saver_built_from_keywords_holds_them_over_the_defaults() -> None:
    with AsyncSaver(commit_timeout=12.5, snapshot="sync", max_in_flight=2) as saver:
        assert saver.options == AsyncSaveOptions(commit_timeout=12.5, snapshot="sync", max_in_flight=2)
        assert (saver.commit_timeout, saver.snapshot, saver.pool.max_arenas) == (12.5, "sync", 2)
    with AsyncSaver() as saver:
        assert saver.options.commit_timeout == AsyncSaveOptions().commit_timeout


def test_keywords_go_over_an_options_model() -> None:
    base = AsyncSaveOptions(commit_timeout=3.0, pipeline=True, snapshot="background")
    with AsyncSaver(options=base, pipeline=False) as saver:
        assert saver.options == AsyncSaveOptions(commit_timeout=3.0, pipeline=False, snapshot="background")
        assert isinstance(saver._snapshot_mode, snapshot_modes.BackgroundSnapshot)


def test_the_manager_passes_its_options_through(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=True, commit_timeout=9.0, snapshot="sync") as manager:
        assert manager.saver is not None
        assert manager.saver.options == AsyncSaveOptions(commit_timeout=9.0, snapshot="sync")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "fork"}, "mode must be 'thread' or 'process', got 'fork'"),
        ({"snapshot": "lazy"}, "snapshot must be 'auto', 'cow', 'sync', 'background' or 'none', got 'lazy'"),
        ({"snapshot": "none", "mode": "process"}, "snapshot='none' works on this process's memory"),
    ],
)
def test_a_bad_option_is_a_value_error_naming_it(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        AsyncSaver(**kwargs)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "snapshot, kind",
    [
        ("sync", snapshot_modes.SyncSnapshot),
        ("background", snapshot_modes.BackgroundSnapshot),
        ("none", snapshot_modes.DirectSnapshot),
    ],
)
def test_each_mode_is_one_strategy_and_saves_the_state_asked_for(tmp_path: Path, snapshot: str, kind: type) -> None:
    w, b = torch.arange(1000, dtype=torch.float32), torch.randn(3, 5, dtype=torch.bfloat16)
    state = {"w": w, "b": b, "step": 4}
    expected_w, expected_b = w.clone(), b.clone()
    with AsyncSaver(snapshot=snapshot) as saver:  # type: ignore[arg-type]
        assert type(saver._snapshot_mode) is kind and saver.snapshot == snapshot
        handle = saver.save(state, tmp_path / "ck", step=4)
        handle.wait_snapshot()
        w.add_(1)  # allowed once the snapshot is done
        handle.result(timeout=120)
    loaded = ucp.load(tmp_path / "ck")
    assert torch.equal(loaded["w"], expected_w) and torch.equal(loaded["b"], expected_b)
    assert loaded["step"] == 4


def test_auto_resolves_once_to_cow_or_sync() -> None:
    with AsyncSaver() as saver:
        assert saver.options.snapshot == "auto"
        assert saver.snapshot in ("cow", "sync")
        assert saver._snapshot_mode.name == saver.snapshot
    with AsyncSaver(mode="process") as saver:
        assert isinstance(saver._snapshot_mode, snapshot_modes.SyncSnapshot)
