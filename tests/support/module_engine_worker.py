"""A Hugging Face GPT-2 (tiny config, random weights) trained through ``training.initialize``, in-process
or as one rank of a gloo world (``serve_scenarios``): the client of tests/training/test_initialize_hf.py.

Data is world-independent: step ``s``'s global batch is :func:`global_batch` (``rows`` rows); with
``world`` ranks and ``gas`` micro-batches each, rank ``r``'s micro-batch ``m`` is rows block
``r·gas + m``, so any world size with ``micro·gas·world = rows`` sees the same stream.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from world import serve_scenarios

import training
from training import saving
from training.offload import checkpoint as offload_checkpoint

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


def corrupting(copy: Callable[[Path, Path], int]) -> Callable[[Path, Path], int]:
    """``copy`` (training.offload.checkpoint.copy_file: a swap file's copy for a checkpoint), then 16 bytes of the
    copy overwritten, so the save that reads it fails its CRC check."""

    def corrupt(src: Path, dst: Path) -> int:
        n = copy(src, dst)
        with open(dst, "r+b") as f:
            os.pwrite(f.fileno(), b"\x7f" * 16, 64)
        return n

    return corrupt


def run(sc: dict[str, Any], rank: int, world: int, out: Path) -> None:
    """``{"name", "stage", "micro", "gas", "steps": [a, b], "load": dir | null, "save": dir | null, "save_at": k}``,
    and optionally the config's ``checkpoint`` section (``{"writer": {"decoupled": true}}``: a decoupled save);
    ``{"faults": true, ...}``: :func:`faults`."""
    if sc.get("faults"):
        return faults(sc, rank, world, out)
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


def faults(sc: dict[str, Any], rank: int, world: int, out: Path) -> None:
    """Decoupled saves into ``sc["save"]`` that fail on rank 1 only (ZeRO-2, the optimizer on NVMe under
    ``sc["nvme"]``, ``sc["micro"]`` rows a rank), then ranks giving different tags, then a save that succeeds, then a
    synchronous one whose ``latest`` rank 0 cannot write. Writes
    what this rank saw to ``<name>-rank<rank>.json``: ``{"start": error, "early": error, "corrupt": [global_steps, call, error],
    "tags": error, "latest": error}`` (each error as ``[type name, message]``)."""
    zero = {"offload_optimizer": {"device": "nvme", "nvme_path": sc["nvme"]}, "sub_group_size": 20_000}
    config = ds_config(2, sc["micro"], 1, zero=zero, checkpoint=sc["checkpoint"])
    engine = training.initialize(gpt2(), config=config)
    root, real, real_copy = Path(sc["save"]), offload_checkpoint.copy_file, saving.TierCopy

    def no_room(*_args: Any) -> Any:
        raise OSError(28, "no room for the copy")

    seen: dict[str, Any] = {}
    try:
        train_steps(engine, range(1), rank, world)
        engine.save_checkpoint(root)
        engine.wait_checkpoints()
        # rank 1's state cannot be encoded (the saver holds that error until the ranks meet): rank 0 got a handle
        try:
            engine.save_checkpoint(root, tag="unsaveable", client_state={"x": {1, 2}} if rank == 1 else None)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            seen["start"] = [type(exc).__name__, str(exc)]
        # rank 1 cannot make its copy of the swap files, before it reaches its saver: rank 0 must not enter it alone
        if rank == 1:
            setattr(saving, "TierCopy", no_room)  # noqa: B010 - mypy refuses a plain assignment of the stand-in
        try:
            engine.save_checkpoint(root, tag="uncopied")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            seen["early"] = [type(exc).__name__, str(exc)]
        finally:
            setattr(saving, "TierCopy", real_copy)  # noqa: B010 - as above
        # rank 1's copy of its swap files is corrupt: its writer fails, rank 0 gives the commit up
        if rank == 1:
            setattr(offload_checkpoint, "copy_file", corrupting(real))  # noqa: B010 - mypy refuses a plain assignment of the stand-in
        engine.save_checkpoint(root, tag="corrupt")
        call = "step"
        try:
            for s in range(1, 4):
                train_steps(engine, range(s, s + 1), rank, world)
                offload_checkpoint.copy_file = real  # the step waited for the copy
            call = "wait_checkpoints"
            engine.wait_checkpoints()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            seen["corrupt"] = [engine.global_steps, call, [type(exc).__name__, str(exc)]]
        finally:
            offload_checkpoint.copy_file = real
        try:
            engine.save_checkpoint(root, tag=f"rank{rank}")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            seen["tags"] = [type(exc).__name__, str(exc)]
        engine.save_checkpoint(root, tag="after")
        engine.wait_checkpoints()
        # a synchronous save whose latest rank 0 cannot write (a directory is in the way of its temporary file)
        if rank == 0:
            (root / ".latest.tmp").mkdir()
        try:
            engine.save_checkpoint(root, tag="sync", decoupled=False)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            seen["latest"] = [type(exc).__name__, str(exc)]
    finally:
        engine.close()
    (out / f"{sc['name']}-rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    sys.exit(serve_scenarios(run))
