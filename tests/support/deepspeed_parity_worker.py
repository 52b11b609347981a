"""One rank of our engine's side of tests/training/test_deepspeed_parity.py: train each scenario,
write its losses and (rank 0) its full fp32 masters.

usage: python deepspeed_parity_worker.py RANK WORLD INIT_FILE OUT_DIR SCENARIOS_JSON
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from world import serve_scenarios

STEPS = 5
SEED = 1234
WORLD = 2
# DeepSpeed's run settings (tools/peers/deepspeed_train.py defaults), spelled out for our engine.
LR, BETAS, EPS, WEIGHT_DECAY, MICRO_BATCH = 1e-3, (0.9, 0.95), 1e-8, 0.01, 2
LOSS_RTOL = {"fp32": 1e-6, "bf16": 2e-2}
# Every element within ``atol``; at most ``outliers`` of the elements further than ``bulk`` apart.
WEIGHT_TOL = {"fp32": dict(atol=1e-4, bulk=1e-6, outliers=2.5e-4), "bf16": dict(atol=2e-2, bulk=2e-3, outliers=1e-2)}


def engine_options(zero_stage: int, dtype: str) -> dict[str, Any]:
    return dict(
        zero_stage=zero_stage,
        dtype=dtype,
        micro_batch=MICRO_BATCH,
        lr=LR,
        beta1=BETAS[0],
        beta2=BETAS[1],
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        optimizer="adamw",
        clip=None,
        seed=SEED,
        data_seed=SEED,
        pad_vocab_to=1,
    )


# -- the worker side ---------------------------------------------------------------------------------


def run_scenario(sc: dict, rank: int, world: int, out: Path) -> None:
    """Train the scenario's engine, write its losses and (rank 0) its full fp32 masters."""
    from safetensors.torch import save_file
    from training_worker import full_tensors

    from training import Engine

    engine = Engine("tiny", mesh={"dp": world}, **sc["options"])
    # DeepSpeed's single AdamW group decays every parameter: give our no-decay group the same decay.
    engine.optimizer.weight_decay = [WEIGHT_DECAY] * len(engine.optimizer.weight_decay)
    losses = [engine.train_step(s) for s in range(sc["steps"])]
    full = full_tensors(engine.checkpoint_targets())
    if rank == 0:
        masters = {name: t.contiguous() for (section, name), t in full.items() if section == "fp32_master"}
        save_file(masters, str(out / f"{sc['name']}.masters.safetensors"))
        (out / f"{sc['name']}.losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    serve_scenarios(run_scenario)
