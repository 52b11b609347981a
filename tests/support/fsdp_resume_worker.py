"""One rank of the FSDP2 / DTensor resume tests (tests/ucp/test_fsdp_resume.py).

usage: python fsdp_resume_worker.py RANK 4 INIT_FILE OUT_DIR

A tiny MLP (6 -> 8 -> 5; 5 output rows split unevenly, one rank of four holding none) with AdamW
and a StepLR scheduler, every rank training on the same batch, so that the loss does not depend on
the sharding. One world of 4 processes (process start-up is most of the cost on a 2-core machine)
runs three phases; the 2-rank phases run on ranks 0-1 alone, their mesh and process group being
that pair (so saves and loads there run in a 2-rank process group, as a 2-process job would):

  train    (2 ranks, FSDP2 on a 1-D mesh): 2 steps, save with ucp.save_state and with DCP, 2 more
           steps (the reference losses).
  resume4  (4 ranks): FSDP2 on 4 ranks from the UCP checkpoint and from DCP's (states compared
           bit-exactly), FSDP x TP on a 2x2 mesh from the UCP checkpoint; each takes step 3; the 2-D
           and 4-rank FSDP models are saved; whole loads give plain tensors equal to the DTensors' full values; a
           DTensor on the 2-rank mesh saved by all 4 ranks is refused on every rank.
  resume2  (2 ranks): FSDP2 on 2 ranks from the 2-D checkpoint and from the 4-rank FSDP2 one takes
           step 4; a plain (full-tensor) checkpoint loads into FSDP2 shards too.

Losses go to OUT_DIR/losses.json (rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from world import init_gloo

import ucp

LR, GAMMA = 0.05, 0.7


def build(kind: str, world: int, pair: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """``pair``: the 2-rank mesh of ranks 0-1, for FSDP on it (``world`` ranks otherwise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))
    if kind == "fsdp":
        fully_shard(model, mesh=pair if pair is not None else init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    else:  # FSDP x TP on a (dp, tp) mesh: colwise then rowwise, FSDP over dp (the colwise weight: _StridedShard)
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> float:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 5, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return float(loss.item())


def locals_of(state: Any) -> list[tuple[str, Any]]:
    """Every leaf of a state as (path, local tensor or value), for bit-exact comparisons."""
    out: list[tuple[str, Any]] = []

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}.{i}")
        elif isinstance(obj, torch.Tensor):
            out.append((path, obj._local_tensor if hasattr(obj, "_local_tensor") else obj))
        else:
            out.append((path, obj))

    walk(state, "")
    return out


def assert_same(a: Any, b: Any) -> None:
    la, lb = locals_of(a), locals_of(b)
    assert [p for p, _ in la] == [p for p, _ in lb], ([p for p, _ in la], [p for p, _ in lb])
    for (path, x), (_, y) in zip(la, lb):
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        assert same, f"{path}: {x!r} != {y!r}"


def train(pair: Any, out: Path) -> list[float]:
    import torch.distributed.checkpoint as dcp

    group = pair.get_group()
    model, opt, sched = build("fsdp", 2, pair)
    losses = [step(model, opt, sched) for _ in range(2)]
    ucp.save_state(out / "ucp1d", model=model, optimizer=opt, scheduler=sched, extra={"step": 2}, process_group=group)
    dcp.save(ucp.get_state(model, opt, sched), checkpoint_id=str(out / "dcp1d"), process_group=group)
    return losses + [step(model, opt, sched) for _ in range(2)]


def refuse_mesh_mismatch(pair: Any, world: int, out: Path) -> None:
    """Bad input: a DTensor on the 2-rank mesh, saved by the 4-rank world: refused on every rank."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    bad = distribute_tensor(torch.ones(3), pair, [Replicate()])
    try:
        ucp.save({"model": {"w": bad}}, out / "bad")
    except ucp.UnsupportedStateError as exc:
        msg = str(exc)
        assert "state_dict['model']['w']" in msg and "spans 2 rank(s) [0, 1]" in msg, msg
        assert f"process group has {world} [0, 1, 2, 3]" in msg, msg
    else:
        raise AssertionError("a DTensor on a mesh smaller than the process group was saved")
    assert not (out / "bad").exists()


def resume4(world: int, out: Path) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    a = build("fsdp", world)
    loaded = ucp.load_state(out / "ucp1d", model=a[0], optimizer=a[1], scheduler=a[2], extra={"step": 0})
    assert loaded["step"] == 2 and a[2].last_epoch == 2, (loaded["step"], a[2].last_epoch)
    assert all(int(s["step"]) == 2 for s in a[1].state.values()), "AdamW step counts not restored"

    b = build("fsdp", world)
    state_b = ucp.get_state(*b)
    dcp.load(state_b, checkpoint_id=str(out / "dcp1d"))
    ucp.set_state(*b, state=state_b)
    assert_same(ucp.get_state(*a), ucp.get_state(*b))  # UCP and DCP resume to the very same bits

    # the DTensor checkpoint read whole: plain tensors equal to the full values
    whole = ucp.load(out / "ucp1d")
    for name, value in a[0].state_dict().items():
        assert torch.equal(whole["model"][name], value.full_tensor()), name

    c = build("2d", world)
    ucp.load_state(out / "ucp1d", model=c[0], optimizer=c[1], scheduler=c[2])
    losses = {"a": step(*a), "b": step(*b), "c": step(*c)}
    ucp.save_state(out / "ucp2d", model=c[0], optimizer=c[1], scheduler=c[2], extra={"step": 3})
    ucp.save_state(out / "ucp4", model=a[0], optimizer=a[1], scheduler=a[2], extra={"step": 3})
    return losses


def resume2(pair: Any, out: Path) -> dict[str, float]:
    group = pair.get_group()
    d = build("fsdp", 2, pair)
    ucp.load_state(out / "ucp2d", model=d[0], optimizer=d[1], scheduler=d[2], process_group=group)
    # a checkpoint of plain (full) tensors loads into the DTensor shards as well
    whole = ucp.load(out / "ucp2d")
    ucp.save({"model": whole["model"]}, out / "plain", process_group=group)
    e = build("fsdp", 2, pair)
    ucp.load(out / "plain", into={"model": ucp.get_state(e[0])["model"]})
    assert_same(d[0].state_dict(), e[0].state_dict())
    f = build("fsdp", 2, pair)  # and the 1-D FSDP checkpoint of 4 ranks
    ucp.load_state(out / "ucp4", model=f[0], optimizer=f[1], scheduler=f[2], process_group=group)
    return {"d": step(*d), "f": step(*f)}


def main() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    torch.set_num_threads(1)
    init_gloo(init, rank, world)
    try:
        pair = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",))  # every rank takes part in making it
        ref = train(pair, out) if rank < 2 else []
        dist.barrier()
        at4 = resume4(world, out)
        refuse_mesh_mismatch(pair, world, out)
        at2 = resume2(pair, out) if rank < 2 else None
        if rank == 0:
            (out / "losses.json").write_text(json.dumps({"ref": ref, "at4": at4, "at2": at2}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
