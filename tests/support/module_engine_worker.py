"""A Hugging Face GPT-2 (tiny config, random weights) trained through ``training.initialize``, in-process
or as one rank of a gloo world (``serve_scenarios``): the client of tests/training/test_initialize_hf.py.

Data is world-independent: step ``s``'s global batch is :func:`global_batch` (``rows`` rows); with
``world`` ranks and ``gas`` micro-batches each, rank ``r``'s micro-batch ``m`` is rows block
``r·gas + m``, so any world size with ``micro·gas·world = rows`` sees the same stream.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from world import serve_scenarios

import training

VOCAB, SEQ, ROWS = 96, 16, 4


def gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,  # no dropout: a run is a function of weights and data (and so comparable)
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(gpt2_config())
    return model


def global_batch(step: int, rows: int = ROWS, distinct: int = 2) -> torch.Tensor:
    """Step ``step``'s tokens: one of ``distinct`` fixed batches (few, so that the loss falls within a few steps)."""
    g = torch.Generator().manual_seed(1000 + step % distinct)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def ds_config(stage: int, micro: int, gas: int, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **extra.pop("zero", {})},
        "steps_per_print": 10,
        **extra,
    }


def train_steps(engine: training.ModuleEngine, steps: range, rank: int = 0, world: int = 1) -> list[float]:
    """Run ``steps`` optimizer steps; returns each step's mean loss over the global batch (the same on every rank)."""
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in steps:
        tokens = global_batch(step)
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(gas):
            block = (rank * gas + m) * micro
            x = tokens[block : block + micro]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        engine.dp.all_reduce(total)
        losses.append(float(total.item()) / (gas * world))
    return losses


def run(sc: dict[str, Any], rank: int, world: int, out: Path) -> None:
    """``{"name", "stage", "micro", "gas", "steps": [a, b], "load": dir | null, "save": dir | null, "save_at": k}``,
    and optionally the config's ``checkpoint`` section (``{"writer": {"decoupled": true}}``: a decoupled save)."""
    extra = {"checkpoint": sc["checkpoint"]} if "checkpoint" in sc else {}
    engine = training.initialize(gpt2(), config=ds_config(sc["stage"], sc["micro"], sc["gas"], **extra))
    try:
        if sc.get("load"):
            engine.load_checkpoint(sc["load"])
        first, last = sc["steps"]
        save_at = sc.get("save_at", last)  # a checkpoint after this many steps, then on to the last
        losses = train_steps(engine, range(first, save_at), rank, world)
        if sc.get("save"):
            engine.save_checkpoint(sc["save"], client_state={"note": "hf", "step": engine.global_steps})
        losses += train_steps(engine, range(save_at, last), rank, world)
    finally:
        engine.close()
    if rank == 0:
        (out / f"{sc['name']}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    sys.exit(serve_scenarios(run))
