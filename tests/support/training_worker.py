"""One rank of a multi-process training test: run scenarios, dump losses and checkpoint pieces.

Usage: training_worker.py RANK WORLD INIT_FILE OUT_DIR SCENARIOS_JSON

Every scenario runs on every rank (each builds its own engine and process groups). Rank 0 writes
``{name}.losses.json``; every rank writes ``{name}.rank{r}.json`` (piece regions and facts about
the run) and ``{name}.rank{r}.safetensors`` (piece values), which the test reassembles.

Scenario kinds: ``engine`` (train an Engine), ``resume`` (train on one mesh, move every piece
through full global tensors into an engine on another mesh, continue), ``module`` (ZeRO around a
plain module).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from training_helpers import module_batch, small_module
from world import serve_scenarios

from training import Engine
from training.adam import AdamConfig
from training.checkpoint import CheckpointTargets, assemble, build_targets
from training.models.gpt import GPTConfig
from training.zero import ZeroOptimizer


def dump(out: Path, name: str, rank: int, targets: CheckpointTargets, extra: dict[str, Any]) -> None:
    info, tensors = [], {}
    pieces = [(s, n, p) for s, n, ps in targets.items() for p in ps]
    for i, (entry, (_, _, piece)) in enumerate(zip(targets.describe(), pieces)):
        tensors[str(i)] = piece.local.detach().reshape(-1).to(torch.float32).contiguous().clone()
        info.append({**entry, "key": str(i)})
    (out / f"{name}.rank{rank}.json").write_text(json.dumps({"pieces": info, **extra}))
    save_file(tensors, str(out / f"{name}.rank{rank}.safetensors"))


def engine_facts(engine: Engine) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "master_dtypes": sorted({str(t.dtype) for t in engine.optimizer.master}),
        "weight_dtypes": sorted({str(p.dtype) for p in engine.model.parameters()}),
        "stats": {k: float(v) for k, v in engine.last_stats.items()},
    }
    g = engine.optimizer.gatherer
    if g is not None:
        facts["stage3"] = {
            "gathers": g.gathers,
            "prefetched": g.prefetched,
            "packed": g.packed,
            "held_after_step": sum(p.numel() for p in engine.model.parameters()),
        }
    return facts


def full_tensors(targets: CheckpointTargets) -> dict[tuple[str, str], torch.Tensor]:
    """Every rank's pieces, gathered and assembled into global tensors (replica 0)."""
    mine = [(s, n, p) for s, n, ps in targets.items() for p in ps]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_key: dict[tuple[str, str], list[Any]] = {}
    for part in everyone:
        for s, n, p in part:
            by_key.setdefault((s, n), []).append(p)
    return {k: assemble(ps, targets.shapes[k[1]])[0] for k, ps in by_key.items()}


def run_engine(sc: dict) -> tuple[list[float], Engine]:
    engine = Engine(GPTConfig(**sc["model"]), mesh=sc["mesh"], **sc["options"])
    return [engine.train_step(s) for s in range(sc["steps"])], engine


def run_resume(sc: dict) -> tuple[list[float], Engine]:
    a = Engine(GPTConfig(**sc["model"]), mesh=sc["mesh"], **sc["options"])
    losses = [a.train_step(s) for s in range(sc["split"])]
    full = full_tensors(a.checkpoint_targets())
    state = a.state_dict_for_checkpoint()
    b = Engine(GPTConfig(**sc["model"]), mesh=sc["then"]["mesh"], **sc["then"]["options"])
    b.load_from_full(
        lambda section, name: full[(section, name)], step=state["step"], adam_step=state["optimizer"]["adam_step"]
    )
    losses += [b.train_step() for _ in range(sc["split"], sc["steps"])]
    return losses, b


def run_module(sc: dict, rank: int, world: int) -> tuple[list[float], CheckpointTargets, dict[str, Any]]:
    module = small_module()
    o = sc["options"]
    opt = ZeroOptimizer.for_module(
        module,
        stage=o["zero_stage"],
        adam=AdamConfig(lr=o["lr"], weight_decay=o["weight_decay"]),
        groups=(("*.bias", "norm.*"), ("*",)),
        group_weight_decay=[0.0, None],
        alignment=o["zero_alignment"],
    )
    losses = []
    for step in range(sc["steps"]):
        x, y = module_batch(step, o["micro_batch"] * world)
        rows = slice(rank * o["micro_batch"], (rank + 1) * o["micro_batch"])
        with opt.forward_context():
            loss = torch.nn.functional.mse_loss(module(x[rows]), y[rows])
        opt.backward(loss)
        opt.step()
        value = loss.detach().double().reshape(1)
        dist.all_reduce(value)
        losses.append(float(value) / world)
    shapes = {n: tuple(buf.shape) for n, buf in opt.view.tensors.items()}
    global_shapes = {n: tuple(p.shape) for n, p in small_module().named_parameters()}
    assert set(shapes) == set(global_shapes)
    return losses, build_targets(opt.buffers(), global_shapes), {}


def run_scenario(sc: dict, rank: int, world: int, out: Path) -> None:
    t0 = time.perf_counter()
    kind = sc.get("kind", "engine")
    if kind == "module":
        losses, targets, facts = run_module(sc, rank, world)
    else:
        losses, engine = (run_resume if kind == "resume" else run_engine)(sc)
        targets, facts = engine.checkpoint_targets(), engine_facts(engine)
    facts["seconds"] = time.perf_counter() - t0
    dump(out, sc["name"], rank, targets, facts)
    if rank == 0:
        (out / f"{sc['name']}.losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    serve_scenarios(run_scenario)
