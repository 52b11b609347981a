"""Shared helpers for the training tests: spawn a gloo world, the single-process reference, reassembly."""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from world import run_world as run_ranks

from reshard import Box, FlatRange, Mesh, check_exact_cover
from reshard.names import name_matches
from training.engine import EngineConfig
from training.layout import GPT_GROUPS
from training.models.gpt import GPT, GPTConfig, batch_for_step

WORKER = Path(__file__).with_name("training_worker.py")

# Plain MLP with an odd d_ff (uneven TP split) and a vocabulary not divisible by tp (padded).
PLAIN = dict(vocab_size=101, n_layer=2, n_head=4, d_model=32, d_ff=51, max_seq=16)
# GQA (2 kv heads), SwiGLU, tied embeddings, no linear biases.
GQA = dict(
    vocab_size=101,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    d_model=32,
    d_ff=48,
    max_seq=16,
    swiglu=True,
    tied_embeddings=True,
    bias=False,
)
# Four layers for pp = 4 (tied embeddings across the first and last stage).
DEEP = {**GQA, "n_layer": 4}
BASE = dict(micro_batch=2, seq_len=16, lr=1e-2, weight_decay=0.1, pad_vocab_to=8, beta2=0.99)


def scenario(name: str, model: dict, mesh: dict, steps: int = 5, **options: Any) -> dict:
    return {"name": name, "model": model, "mesh": mesh, "steps": steps, "options": {**BASE, **options}}


def run_world(world: int, scenarios: list[dict], out: Path, timeout: float = 120, worker: Path | None = None) -> None:
    """Run ``scenarios`` on ``world`` fresh processes of ``worker`` (default training_worker.py; gloo); raise
    with their output if any fails."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    init = out / "init"
    init.unlink(missing_ok=True)  # a stale rendezvous file would hang the file:// store
    run_ranks(worker or WORKER, lambda r: [r, world, init, out, spec], world, timeout=timeout)


@dataclass
class Reference:
    losses: list[float]
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]

    @classmethod
    def after(cls, losses: list[float], named: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer) -> Reference:
        """The losses, and copies of the parameters and of ``opt``'s Adam moments, at the end of a run."""
        state = {n: opt.state[p] for n, p in named.items()}
        return cls(
            losses,
            {n: p.detach().clone() for n, p in named.items()},
            {n: s["exp_avg"].clone() for n, s in state.items()},
            {n: s["exp_avg_sq"].clone() for n, s in state.items()},
        )


def reference_run(sc: dict) -> Reference:
    """The same run in one process: plain GPT, the global batch, torch.optim.AdamW, clip_grad_norm_."""
    cfg = EngineConfig(model=GPTConfig(**sc["model"]), mesh=Mesh(**sc["mesh"]), **sc["options"])
    torch.manual_seed(0)
    model = GPT(cfg.model, seed=cfg.seed)
    named = dict(model.named_parameters())
    no_decay = [n for n in named if any(name_matches(p, n) for p in GPT_GROUPS[0])]
    groups = [
        {"params": [named[n] for n in no_decay], "weight_decay": 0.0},
        {"params": [p for n, p in named.items() if n not in no_decay], "weight_decay": cfg.weight_decay},
    ]
    Opt = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    opt = Opt(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    losses = []
    for step in range(sc["steps"]):
        tokens, targets = batch_for_step(step, cfg.global_batch, cfg.seq, cfg.model.vocab_size, cfg.data_seed)
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        losses.append(loss.item())
    return Reference.after(losses, named, opt)


@dataclass
class Gathered:
    """Every rank's pieces of one scenario, reassembled."""

    losses: list[float]
    full: dict[tuple[str, str], torch.Tensor]  # (section, name) -> global tensor from replica-0 pieces
    cover_problems: list[str]
    replicas_agree: bool
    ranks: list[dict[str, Any]]


def gather(out: Path, name: str, world: int, shapes: dict[str, tuple[int, ...]]) -> Gathered:
    """Reassemble the global tensors from the replica-0 pieces of all ranks; check the cover and the replicas."""
    regions: dict[tuple[str, str], list[Box | FlatRange]] = {}
    full: dict[tuple[str, str], torch.Tensor] = {}
    replicas: list[tuple[tuple[str, str], Box | FlatRange, torch.Tensor]] = []
    ranks = []
    for r in range(world):
        meta = json.loads((out / f"{name}.rank{r}.json").read_text())
        values = load_file(str(out / f"{name}.rank{r}.safetensors"))
        ranks.append(meta)
        for p in meta["pieces"]:
            key = (p["section"], p["name"])
            t = full.setdefault(key, torch.full(shapes[p["name"]], float("nan")))
            region: Box | FlatRange = (
                FlatRange(*p["flat"]) if "flat" in p else Box(tuple(p["offsets"]), tuple(p["shape"]))
            )
            v = values[p["key"]]
            regions.setdefault(key, [])
            if p["replica"] == 0:
                regions[key].append(region)
                _view(t, region).copy_(v.view(_view(t, region).shape))
            else:
                replicas.append((key, region, v))
    problems = []
    for key, regs in regions.items():
        why = check_exact_cover(regs, shapes[key[1]])
        if why is not None:
            problems.append(f"{key}: {why}")
    agree = all(torch.equal(_view(full[k], reg).reshape(-1), v) for k, reg, v in replicas)
    losses = json.loads((out / f"{name}.losses.json").read_text())
    return Gathered(losses, full, problems, agree, ranks)


def _view(t: torch.Tensor, region: Box | FlatRange) -> torch.Tensor:
    return t.view(-1)[region.start : region.stop] if isinstance(region, FlatRange) else t[region.slices()]


def rel_close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


# -- a plain module for ZeRO without the GPT ------------------------------------------------------


def small_module() -> torch.nn.Module:
    """Linear-GELU-Linear-LayerNorm with odd sizes (ZeRO partitions cut parameters mid-way)."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        collections.OrderedDict(
            fc1=torch.nn.Linear(7, 13), act=torch.nn.GELU(), fc2=torch.nn.Linear(13, 5), norm=torch.nn.LayerNorm(5)
        )
    )


def module_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 7, generator=g), torch.randn(rows, 5, generator=g)


def module_reference(sc: dict, world: int) -> Reference:
    module = small_module()
    o = sc["options"]
    named = dict(module.named_parameters())
    no_decay = [n for n in named if n.endswith(".bias") or n.startswith("norm.")]
    groups: list[dict[str, Any]] = [
        {"params": [named[n] for n in no_decay], "weight_decay": 0.0},
        {"params": [p for n, p in named.items() if n not in no_decay]},
    ]
    opt = torch.optim.AdamW(
        groups,
        lr=o["lr"],
        weight_decay=o["weight_decay"],
    )
    losses = []
    for step in range(sc["steps"]):
        x, y = module_batch(step, o["micro_batch"] * world)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return Reference.after(losses, named, opt)
