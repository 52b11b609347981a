"""Optimizer steps wait for deferred snapshots (ucp.saving.step_guard): a training loop that steps right after
``AsyncSaver(snapshot="background" | "none").save`` without ``wait_snapshot()`` still commits the state
it asked to save, bit-exact; without the guard the same loop fails its save (the version check)."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from ucp_helpers import assert_same_state

import ucp
from ucp.saving import step_guard
from ucp.saving.async_save import AsyncSaver


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(16, 64, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _copy(state: dict) -> dict:
    return {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "optim": {
            "state": {
                k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in s.items()}
                for k, s in state["optim"]["state"].items()
            },
            "param_groups": state["optim"]["param_groups"],
        },
    }


def _slow(monkeypatch: pytest.MonkeyPatch, module_name: str, attr: str, started: threading.Event) -> None:
    """The deferred read starts late (0.5 s), so that the step comes first unless it waits."""
    module = sys.modules[module_name]
    real = getattr(module, attr)

    def late(*args, **kw):
        started.set()
        time.sleep(0.5)
        return real(*args, **kw)

    monkeypatch.setattr(module, attr, late)


@pytest.mark.parametrize(
    "snapshot, module_name, attr",
    [
        ("background", "ucp.saving.snapshot", "snapshot_into"),
        ("none", "ucp.saving.background.execute", "write_rank_file"),
    ],
)
def test_a_step_right_after_save_waits_and_the_saved_state_is_the_one_asked_for(
    tmp_path, monkeypatch, snapshot, module_name, attr
):
    model, opt = _model_and_optimizer(0)
    _train_step(model, opt, 1)  # Adam has moments now
    expected = _copy(_state(model, opt))
    started = threading.Event()
    _slow(monkeypatch, module_name, attr, started)
    with AsyncSaver(snapshot=snapshot) as saver:
        h = saver.save(_state(model, opt), tmp_path / "ck", step=1)
        assert step_guard.running() >= 1
        _train_step(model, opt, 2)  # no wait_snapshot(): the step itself waits
        assert h.snapshot_done() and started.is_set()
        h.result(timeout=120)
    assert_same_state(expected, ucp.load(tmp_path / "ck"))
    assert not torch.equal(model.state_dict()["0.weight"], expected["model"]["0.weight"])  # the step did happen
    assert step_guard.running() == 0


def test_without_the_guard_the_same_loop_fails_its_save(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(0)
    _train_step(model, opt, 1)
    _slow(monkeypatch, "ucp.saving.snapshot", "snapshot_into", threading.Event())
    with AsyncSaver(snapshot="background", hold_optimizer_steps=False) as saver:
        h = saver.save(_state(model, opt), tmp_path / "ck", step=1)
        _train_step(model, opt, 2)
        with pytest.raises(ucp.CheckpointError, match="was changed in place"):
            h.result(timeout=120)


def test_copying_snapshots_hold_nothing_and_a_failed_snapshot_does_not_stop_the_step(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(0)
    with AsyncSaver() as saver:  # snapshot="sync": copied before save returns
        saver.save(_state(model, opt), tmp_path / "a", step=1)
        assert step_guard.running() == 0
        saver.wait()
    failed: Future = Future()
    step_guard.hold_steps_until(failed)
    failed.set_exception(RuntimeError("the copy failed"))  # its save raises it, not the optimizer
    _train_step(model, opt, 3)
    assert step_guard.running() == 0


def test_a_step_waits_only_for_snapshots_running_when_it_starts(tmp_path):
    model, opt = _model_and_optimizer(0)
    gate: Future = Future()
    step_guard.hold_steps_until(gate)
    stepped = threading.Event()

    def step() -> None:
        _train_step(model, opt, 4)
        stepped.set()

    t = threading.Thread(target=step)
    t.start()
    assert not stepped.wait(0.3)  # held by the running snapshot
    gate.set_result(None)
    assert stepped.wait(30)
    t.join()
    _train_step(model, opt, 5)  # nothing running: no wait
