"""DTensors in one process: saved (sync and async) and loaded into other placements and plain tensors;
Partial targets refused naming the key; ucp.save_state/load_state restore a plain model, a fresh
optimizer (moments and step counts) and an LR scheduler. The multi-process cases (FSDP2, 2-D meshes,
other world sizes) are in tests/ucp/test_fsdp_resume.py."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

import ucp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def mesh() -> Iterator[object]:
    from torch.distributed.tensor import DeviceMesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def test_dtensors_load_into_other_placements_and_plain_tensors(tmp_path: Path, mesh: object) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.randn(5, 3)
    ucp.save({"m": {"w": distribute_tensor(full, mesh, [Shard(0)])}, "n": 4}, tmp_path / "c")  # type: ignore[arg-type]
    assert ucp.read_manifest(tmp_path / "c").metadata["dtensor"]["m.w"]["placements"] == ["Shard(dim=0)"]
    assert torch.equal(ucp.load(tmp_path / "c")["m"]["w"], full)  # plain tensors from a DTensor checkpoint
    for placement in (Shard(1), Replicate()):
        into = {"m": {"w": distribute_tensor(torch.zeros(5, 3), mesh, [placement])}}  # type: ignore[arg-type]
        ucp.load(tmp_path / "c", into=into)
        assert torch.equal(into["m"]["w"].full_tensor(), full)
    # and back: a plain checkpoint into a DTensor
    ucp.save({"w": full * 2}, tmp_path / "plain")
    target = {"w": distribute_tensor(torch.zeros(5, 3), mesh, [Shard(1)])}  # type: ignore[arg-type]
    ucp.load(tmp_path / "plain", into=target)
    assert torch.equal(target["w"].full_tensor(), full * 2)


def test_async_save_of_dtensors_keeps_user_metadata(tmp_path: Path, mesh: object) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(12.0).reshape(4, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])  # type: ignore[arg-type]
    with ucp.AsyncSaver() as saver:
        saver.save({"w": dt}, tmp_path / "a").result()
        saver.save({"w": dt}, tmp_path / "b", metadata={"dtensor": "mine"}).result()
    assert torch.equal(ucp.load(tmp_path / "a")["w"], full)
    assert ucp.read_manifest(tmp_path / "a").metadata["dtensor"]["w"]["dims"] == "(dp d0) d1"
    assert ucp.read_manifest(tmp_path / "b").metadata["dtensor"] == "mine"


def test_a_partial_target_is_refused_naming_its_key(tmp_path: Path, mesh: object) -> None:
    from torch.distributed.tensor import DTensor, Partial

    ucp.save({"model": {"w": torch.ones(2, 2)}}, tmp_path / "c")
    into = {"model": {"w": DTensor.from_local(torch.zeros(2, 2), mesh, [Partial()])}}  # type: ignore[arg-type]
    with pytest.raises(ucp.LayoutMismatchError, match=r"state_dict\['model'\]\['w'\].*Partial\(sum\)"):
        ucp.load(tmp_path / "c", into=into)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_save_state_load_state_restore_a_fresh_optimizer_and_scheduler(tmp_path: Path) -> None:
    model, opt, sched = _trained()
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    ucp.save_state(tmp_path / "c", model=model, optimizer=opt, scheduler=sched, extra={"epoch": 7})

    fresh, fresh_opt, fresh_sched = _trained()
    assert not fresh_opt.state
    out = ucp.load_state(tmp_path / "c", model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, extra={"epoch": 0})
    assert out["epoch"] == 7
    assert fresh_sched.state_dict() == sched.state_dict() and fresh_opt.param_groups[0]["lr"] == 0.1 * 0.5**3
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    assert float(fresh_opt.state[next(fresh.parameters())]["step"]) == 3.0
    with pytest.raises(ucp.UnsupportedStateError, match="extra key 'model'"):
        ucp.save_state(tmp_path / "d", model=model, extra={"model": 1})
