"""A rank of tests/ucp/test_tiered_node_local_async.py: asynchronous saves to a node-local tier (each rank
its own directory ``OUT/<kind>/node<rank>``) replicated to the loopback S3 server, through
:func:`world.serve_scenarios`. A scenario is ``{"kind": "ok"|"upload-fails", "remote": URL, "steps": [...],
"options": {rank: storage options},
"commit_timeout": s}``; each rank writes what it saw to ``OUT/<kind>-rank<rank>.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from world import serve_scenarios

import ucp

W = (8, 6)  # a global tensor every rank holds half of, so every rank writes a file of its own


def full(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(W, generator=g)


def state(step: int, rank: int) -> dict[str, Any]:
    half = W[0] // 2
    w = ucp.ShardedTensor(full(step)[rank * half : (rank + 1) * half].clone(), W, (rank * half, 0))
    return {"w": w, "step": step}


def run(sc: dict[str, Any], rank: int, world: int, out: Path) -> None:
    opts = sc.get("options", {}).get(str(rank))
    node = out / sc["kind"] / f"node{rank}"
    manager = ucp.CheckpointManager(
        node,
        keep_last=1,
        async_save=True,
        remote=sc["remote"],
        remote_storage_options=opts,
        node_local=True,
        commit_timeout=sc.get("commit_timeout", 60),
        replicate_timeout=60,
    )
    seen: dict[str, Any] = {"handles": [], "errors": []}
    for step in sc["steps"]:
        handle = manager.save(state(step, rank), step)
        seen["handles"].append(type(handle).__name__)
    try:
        manager.wait()  # the local commits, then the replications
    except Exception as exc:  # noqa: BLE001 - what the test asserts on
        seen["errors"].append(f"{type(exc).__name__}: {exc}")
    manager.close()
    seen["local"] = sorted(str(p.relative_to(node)) for p in node.rglob("*") if p.is_file())
    (out / f"{sc['kind']}-rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    serve_scenarios(run)
