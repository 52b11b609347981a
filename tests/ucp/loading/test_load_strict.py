"""``ucp.load(path, into=...)`` is strict by default: one error names every missing and unexpected key
(with a hint when a prefix or a fresh optimizer explains the mismatch), before anything is read; the
top level of ``into`` only selects sections. ``strict=False`` fills what matches and reports what was
and was not filled. ``map_location`` for whole loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucp


@pytest.fixture()
def model_ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {"w1": torch.arange(12.0).reshape(3, 4), "w2": torch.arange(5, dtype=torch.int64)}
    path = tmp_path / "m"
    ucp.save({"model": sd, "step": 7}, path)
    return path, sd


def test_a_full_match_loads_strictly(model_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, sd = model_ckpt
    into: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}, "step": None}
    out = ucp.load(path, into=into)
    assert out is into and into["step"] == 7
    assert all(torch.equal(into["model"][k], sd[k]) for k in sd)


def test_a_checkpoint_saved_under_model_suggests_the_prefix(model_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, sd = model_ckpt
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(ucp.LayoutMismatchError) as info:
        ucp.load(path, into=into)
    msg = str(info.value)
    assert "missing from the checkpoint" in msg and "state_dict['w1']" in msg and "state_dict['w2']" in msg
    assert "the checkpoint's other top-level keys: state_dict['model'], state_dict['step']" in msg
    assert "did you mean into={'model': ...}" in msg
    assert all(not v.any() for v in into.values())  # nothing was read into the target


def test_a_wrapped_into_on_a_flat_checkpoint_suggests_unwrapping(tmp_path: Path) -> None:
    ucp.save({"w1": torch.ones(2), "w2": torch.ones(3)}, tmp_path / "flat")
    with pytest.raises(ucp.LayoutMismatchError, match=r"pass that dict itself \(into=into\['model'\]\)"):
        ucp.load(tmp_path / "flat", into={"model": {"w1": torch.zeros(2), "w2": torch.zeros(3)}})


def test_missing_and_unexpected_keys_are_reported_together(model_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, sd = model_ckpt
    into: dict[str, Any] = {"model": {"w1": torch.zeros(3, 4), "w3": torch.zeros(2)}, "step": None}
    with pytest.raises(ucp.LayoutMismatchError) as info:
        ucp.load(path, into=into)
    msg = str(info.value)
    assert "state_dict['model']['w3']" in msg.split("unexpected (saved")[0]  # missing
    assert "state_dict['model']['w2']" in msg.split("unexpected (saved")[1]
    assert "strict=False" in msg
    assert not into["model"]["w1"].any() and into["step"] is None


def test_non_strict_fills_what_matches_and_reports(model_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, sd = model_ckpt
    into = {"model": {"w1": torch.zeros(3, 4), "w3": torch.zeros(2)}}
    report = ucp.load(path, into=into, strict=False)
    assert isinstance(report, ucp.LoadReport) and report.state is into
    assert torch.equal(into["model"]["w1"], sd["w1"]) and not into["model"]["w3"].any()
    assert report.loaded == [("model", "w1")]
    assert report.missing == [("model", "w3")]
    assert report.unexpected == [("model", "w2")] and report.skipped == [("step",)]
    assert not report.complete


def test_the_top_level_selects_sections(tmp_path: Path) -> None:
    """The README's ``into={"model": model.state_dict()}`` of a checkpoint that also holds the optimizer."""
    model = torch.nn.Linear(3, 2)
    ucp.save({"model": model.state_dict(), "optim": {"m": torch.ones(3)}, "step": 4}, tmp_path / "c")
    fresh = torch.nn.Linear(3, 2)
    ucp.load(tmp_path / "c", into={"model": fresh.state_dict()})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    report = ucp.load(tmp_path / "c", into={"model": fresh.state_dict()}, strict=False)
    assert report.complete and report.skipped == [("optim",), ("step",)]


def test_non_strict_whole_load_reports_everything_loaded(model_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, sd = model_ckpt
    report = ucp.load(path, strict=False)
    assert isinstance(report, ucp.LoadReport) and report.complete
    assert torch.equal(report.state["model"]["w1"], sd["w1"]) and report.state["step"] == 7


def test_a_fresh_optimizer_is_not_silently_left_empty(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ucp.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "o")
    fresh = torch.optim.AdamW(model.parameters())
    with pytest.raises(ucp.LayoutMismatchError) as info:
        ucp.load(tmp_path / "o", into={"model": model.state_dict(), "optim": fresh.state_dict()})
    msg = str(info.value)
    assert "state_dict['optim']['state'][0]" in msg and "state_dict['optim']['state'][1]" in msg
    assert "state_dict['optim']['state'] is empty in into=" in msg and "fresh optimizer" in msg
    # what the hint says works: the optimizer's part loaded whole
    fresh.load_state_dict(ucp.load(tmp_path / "o")["optim"])
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def test_many_keys_are_counted_not_all_listed(tmp_path: Path) -> None:
    ucp.save({"m": {f"t{i}": torch.zeros(1) for i in range(30)}}, tmp_path / "many")
    with pytest.raises(ucp.LayoutMismatchError, match=r"state_dict\['m'\]\['t11'\] and 18 more"):
        ucp.load(tmp_path / "many", into={"m": {}})


def test_the_manager_and_aload_take_strict(tmp_path: Path) -> None:
    import asyncio

    state = {"s": {"a": torch.ones(2), "b": torch.ones(2)}}
    ucp.save(state, tmp_path / "c")
    with pytest.raises(ucp.LayoutMismatchError, match=r"state_dict\['s'\]\['b'\]"):
        asyncio.run(ucp.aload(tmp_path / "c", into={"s": {"a": torch.zeros(2)}}))
    report = asyncio.run(ucp.aload(tmp_path / "c", into={"s": {"a": torch.zeros(2)}}, strict=False))
    assert report.unexpected == [("s", "b")] and torch.equal(report.state["s"]["a"], torch.ones(2))
    mgr = ucp.CheckpointManager(tmp_path / "run")
    try:
        mgr.save(state, 1)
        mgr.wait()
        with pytest.raises(ucp.LayoutMismatchError, match=r"state_dict\['s'\]\['b'\]"):
            mgr.load(1, into={"s": {"a": torch.zeros(2)}})
        assert mgr.load(1, into={"s": {"a": torch.zeros(2)}}, strict=False).unexpected == [("s", "b")]
    finally:
        mgr.close()


# -- map_location -------------------------------------------------------------------------------------


def test_map_location_cpu_keeps_dtypes_bit_exact(tmp_path: Path) -> None:
    state = {"h": torch.randn(4, 3).to(torch.bfloat16), "i": torch.arange(6, dtype=torch.int32), "f": torch.randn(5)}
    ucp.save(state, tmp_path / "c")
    for where in ("cpu", torch.device("cpu")):
        out = ucp.load(tmp_path / "c", map_location=where)
        for k, v in state.items():
            assert out[k].dtype == v.dtype and out[k].device.type == "cpu"
            assert torch.equal(
                out[k].view(torch.uint8) if v.dtype == torch.bfloat16 else out[k],
                v.view(torch.uint8) if v.dtype == torch.bfloat16 else v,
            )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_map_location_cuda_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    ucp.save({"w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(ucp.CheckpointError, match=r"map_location='cuda': CUDA is not available"):
        ucp.load(tmp_path / "c", map_location="cuda")
    with pytest.raises(ucp.CheckpointError, match=r"map_location='cuda:1': CUDA is not available"):
        ucp.load(tmp_path / "c", map_location=torch.device("cuda", 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_map_location_cuda_loads_onto_the_gpu(tmp_path: Path) -> None:
    state = {"h": torch.randn(4, 3).to(torch.bfloat16), "i": torch.arange(6, dtype=torch.int32)}
    ucp.save(state, tmp_path / "c")
    out = ucp.load(tmp_path / "c", map_location="cuda")
    for k, v in state.items():
        assert out[k].device.type == "cuda" and out[k].dtype == v.dtype and torch.equal(out[k].cpu(), v)


def test_map_location_bad_values_are_named(tmp_path: Path) -> None:
    ucp.save({"w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(ucp.CheckpointError, match=r"map_location='gpu0' is not a device"):
        ucp.load(tmp_path / "c", map_location="gpu0")
    with pytest.raises(ucp.CheckpointError, match=r"map_location applies to whole loads"):
        ucp.load(tmp_path / "c", into={"w": torch.zeros(2)}, map_location="cpu")
