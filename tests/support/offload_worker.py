"""One rank of a multi-process offload test: train the same GPT with and without optimizer offload.

Usage: offload_worker.py RANK WORLD INIT_FILE OUT_DIR SCENARIOS_JSON

Scenario: ``{"name", "model": GPTConfig fields, "mesh", "options": Engine options, "offload": OffloadConfig
fields or null, "steps"}``, optionally ``"save_at": k, "ckpt": ROOT`` (save after step k into a
CheckpointManager at ROOT) and ``"load": DIR`` (resume from that checkpoint first). Every rank writes ``{name}.rank{r}.json``: the losses, a SHA-256 of its weights
after the last step, the offload tier's description and last-step figures, its state bytes, and whether
its swap directory was gone once the engine was closed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from world import serve_scenarios

import ucp
from training import Engine
from training.models.gpt import GPTConfig
from training.offload import OffloadConfig


def weights_digest(engine: Engine) -> str:
    """SHA-256 over this rank's compute-dtype weights (flat buffers, or stage-3 partitions: read from their swap
    files where the parameters are on NVMe)."""
    h = hashlib.sha256()
    opt = engine.optimizer
    tier = getattr(opt, "param_tier", None)
    parts = tier.stage() if tier is not None else opt.param_part
    for t in [*opt.flat_param, *parts]:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    if tier is not None:
        tier.drop_staged()
    return h.hexdigest()


def run_scenario(sc: dict[str, Any], rank: int, world: int, out: Path) -> None:
    offload = OffloadConfig.model_validate(sc["offload"]) if sc.get("offload") else OffloadConfig()
    engine = Engine(GPTConfig(**sc["model"]), mesh=sc["mesh"], offload=offload, **sc["options"])
    first = engine.load(sc["load"]) if sc.get("load") else 0
    losses = []
    for s in range(first, sc["steps"]):
        losses.append(engine.train_step(s))
        if sc.get("save_at") == s + 1:
            engine.save(ucp.CheckpointManager(sc["ckpt"]))
    off = engine.optimizer.offload
    facts: dict[str, Any] = {
        "losses": losses,
        "digest": weights_digest(engine),
        "state_bytes": 12 * sum(p.size for p in engine.optimizer.plans),
        "tier": off.describe() if off is not None else None,
        "last": off.last if off is not None else None,
        "params": _param_facts(engine),
    }
    swap_dir = Path(off.describe()["dir"]) if off is not None and off.device == "nvme" else None
    engine.close()
    facts["dir_removed"] = None if swap_dir is None else not swap_dir.exists()
    (out / f"{sc['name']}.rank{rank}.json").write_text(json.dumps(facts))


def _param_facts(engine: Engine) -> dict[str, Any] | None:
    """The parameter tier's shape and I/O figures (ZeRO-3 with offload_param nvme), else None."""
    tier = getattr(engine.optimizer, "param_tier", None)
    if tier is None:
        return None
    largest = max(p.numel for p in tier.offload.partitions)
    return {**tier.offload.describe(), **tier.offload.stats(), "largest_partition": largest}


if __name__ == "__main__":
    serve_scenarios(run_scenario)
