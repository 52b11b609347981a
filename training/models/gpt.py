"""A small, plain-torch reference GPT and a deterministic synthetic data source.

Why it exists: UCP's importer tests, reshard benchmarks and training-parity tests need one model
that every peer (DeepSpeed, our own ZeRO, DCP) trains identically. Parameter names follow the
Megatron/DeepSpeed GPT spirit so imported checkpoints look like real ones:

    embed.weight                      [vocab, d_model]    (also the output head when tied)
    layers.{i}.ln1.weight / .bias     [d_model]
    layers.{i}.attn.qkv.weight        [(n_head + 2*n_kv_head) * head_dim, d_model], rows [q; k; v]
    layers.{i}.attn.qkv.bias          [(n_head + 2*n_kv_head) * head_dim]           (bias=True)
    layers.{i}.attn.proj.weight       [d_model, n_head * head_dim]
    layers.{i}.attn.proj.bias         [d_model]                                      (bias=True)
    layers.{i}.ln2.weight / .bias     [d_model]
    layers.{i}.mlp.fc1.weight         [d_ff, d_model], or [2*d_ff, d_model] rows [gate; up] (swiglu)
    layers.{i}.mlp.fc1.bias           [d_ff] or [2*d_ff]                              (bias=True)
    layers.{i}.mlp.fc2.weight         [d_model, d_ff]
    layers.{i}.mlp.fc2.bias           [d_model]                                      (bias=True)
    ln_f.weight / .bias               [d_model]
    head.weight                       [vocab, d_model]    (absent when tied_embeddings)

Positions use rotary embeddings (no parameters). There is no dropout, so a run is a pure
function of (config, seed, data seed, optimizer settings).

Tied embeddings: the output projection calls the `embed` module a second time
(`embed(h, unembed=True)`) instead of aliasing the Parameter into a second module. That keeps one
name (`embed.weight`) in `named_parameters()` and `state_dict()`, and DeepSpeed ZeRO-3 gathers
the partitioned weight through its normal per-module forward hooks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

__all__ = [
    "GPTConfig",
    "GPT",
    "PRESETS",
    "expected_param_shapes",
    "batch_for_step",
    "rows_for_step",
]


class GPTConfig(BaseModel):
    """Shape of the reference GPT. `n_kv_head` defaults to `n_head` (plain multi-head attention)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(gt=0)
    n_layer: int = Field(gt=0)
    n_head: int = Field(gt=0)
    n_kv_head: int | None = Field(default=None, gt=0)
    d_model: int = Field(gt=0)
    d_ff: int = Field(gt=0)
    max_seq: int = Field(gt=0)
    tied_embeddings: bool = False
    swiglu: bool = False
    bias: bool = True
    rope_base: float = 10000.0
    init_std: float = 0.02

    @model_validator(mode="after")
    def _check_heads(self) -> "GPTConfig":
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.kv_heads}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        return sum(math.prod(s) for s in expected_param_shapes(self).values())


PRESETS: dict[str, GPTConfig] = {
    # ~0.85M parameters, fast enough for multi-rank DeepSpeed runs in tests. The odd d_ff makes
    # some tensors (fc1.bias: 509) and the total parameter count odd, so ZeRO partitions carry
    # padding at every world size: importers must get padding right to pass.
    "tiny": GPTConfig(vocab_size=1000, n_layer=3, n_head=4, d_model=128, d_ff=509, max_seq=64),
    # ~0.84M parameters with GQA (2 kv heads), SwiGLU (fused gate/up), tied embeddings, no
    # linear biases: exercises the fused-layout and aliasing variants.
    "tiny-gqa": GPTConfig(
        vocab_size=1000,
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        d_model=128,
        d_ff=343,
        max_seq=64,
        tied_embeddings=True,
        swiglu=True,
        bias=False,
    ),
    # ~13.8M parameters.
    "small": GPTConfig(vocab_size=4096, n_layer=6, n_head=8, d_model=384, d_ff=1536, max_seq=256),
    # ~97.6M parameters (GPT-2-small body, 8k vocabulary, untied): for reshard benchmarks.
    "gpt-100m": GPTConfig(vocab_size=8192, n_layer=12, n_head=12, d_model=768, d_ff=3072, max_seq=1024),
}


def expected_param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name and shape the model registers, in registration order."""
    hd, d = cfg.head_dim, cfg.d_model
    qkv_rows = (cfg.n_head + 2 * cfg.kv_heads) * hd
    fc1_rows = 2 * cfg.d_ff if cfg.swiglu else cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        layer = {
            "ln1.weight": (d,),
            "ln1.bias": (d,),
            "attn.qkv.weight": (qkv_rows, d),
            "attn.qkv.bias": (qkv_rows,),
            "attn.proj.weight": (d, cfg.n_head * hd),
            "attn.proj.bias": (d,),
            "ln2.weight": (d,),
            "ln2.bias": (d,),
            "mlp.fc1.weight": (fc1_rows, d),
            "mlp.fc1.bias": (fc1_rows,),
            "mlp.fc2.weight": (d, cfg.d_ff),
            "mlp.fc2.bias": (d,),
        }
        for k, s in layer.items():
            if cfg.bias or not k.endswith(".bias") or k.startswith("ln"):
                shapes[p + k] = s
    shapes["ln_f.weight"] = (d,)
    shapes["ln_f.bias"] = (d,)
    if not cfg.tied_embeddings:
        shapes["head.weight"] = (cfg.vocab_size, d)
    return shapes


class Embedding(nn.Module):
    """Token embedding that can also act as the tied output projection."""

    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, d_model))

    def forward(self, x: torch.Tensor, unembed: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight) if unembed else F.embedding(x, self.weight)


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding on [batch, heads, seq, head_dim] (rotate-half convention)."""
    seq, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32, device=x.device), inv)
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * hd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_head * hd, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, (b, t, _) = self.cfg, x.shape
        hd, nq, nkv = cfg.head_dim, cfg.n_head, cfg.kv_heads
        q, k, v = self.qkv(x).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q = _rope(q.view(b, t, nq, hd).transpose(1, 2), cfg.rope_base)
        k = _rope(k.view(b, t, nkv, hd).transpose(1, 2), cfg.rope_base)
        v = v.view(b, t, nkv, hd).transpose(1, 2)
        if nkv != nq:  # GQA: each kv head serves n_head // n_kv_head consecutive query heads
            k = k.repeat_interleave(nq // nkv, dim=1)
            v = v.repeat_interleave(nq // nkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, nq * hd))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.swiglu
        self.fc1 = nn.Linear(cfg.d_model, (2 if cfg.swiglu else 1) * cfg.d_ff, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-LayerNorm decoder. `forward(tokens, targets)` returns the mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig, seed: int | None = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = None if cfg.tied_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if seed is not None:
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 style init drawn from one CPU generator in registration order.

        Values depend only on (config, seed), never on the global RNG, device or rank, so every
        process of every peer starts from identical weights.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                vals = torch.zeros(p.shape)
            elif name.startswith("ln") or ".ln" in name:
                vals = torch.ones(p.shape)
            else:
                std = residual_std if name.endswith(("proj.weight", "fc2.weight")) else self.cfg.init_std
                vals = torch.randn(p.shape, generator=gen) * std
            p.copy_(vals.to(p.dtype))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if tokens.shape[-1] > self.cfg.max_seq:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds max_seq={self.cfg.max_seq}")
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.ln_f(h)
        logits = self.embed(h, unembed=True) if self.head is None else self.head(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


# --- deterministic synthetic data -------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _mix(*words: int) -> int:
    """SplitMix64-style hash of integers: independent, collision-resistant generator seeds."""
    h = 0x9E3779B97F4A7C15
    for w in words:
        h = (h ^ (w & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


def rows_for_step(
    step: int, rows: range, seq: int, vocab: int, seed: int, noise: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` of the global batch for `step`: (tokens, targets), int64 [len(rows), seq].

    Each row is an arithmetic progression modulo `vocab` (random start and stride) with a
    `noise` fraction of positions replaced by random tokens, so loss falls but never reaches 0.
    A row depends only on (seed, step, row index): any split of the global batch over ranks or
    micro-batches sees the same data, and a resumed run continues the exact same stream.
    """
    out = torch.empty(len(rows), seq + 1, dtype=torch.int64)
    pos = torch.arange(seq + 1, dtype=torch.int64)
    for j, r in enumerate(rows):
        gen = torch.Generator().manual_seed(_mix(seed, step, r))
        start = int(torch.randint(0, vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        row = (start + stride * pos) % vocab
        flip = torch.rand(seq + 1, generator=gen) < noise
        row[flip] = torch.randint(0, vocab, (int(flip.sum()),), generator=gen)
        out[j] = row
    return out[:, :-1].contiguous(), out[:, 1:].contiguous()


def batch_for_step(
    step: int,
    micro_batch: int,
    seq: int,
    vocab: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    micro_step: int = 0,
    grad_accum: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch for optimizer step `step` (0-based).

    The global batch of a step has `micro_batch * world_size * grad_accum` rows; rank `rank`'s
    micro-step `micro_step` takes a contiguous block of them (data-parallel split).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    if not 0 <= micro_step < grad_accum:
        raise ValueError(f"micro_step {micro_step} outside grad_accum {grad_accum}")
    first = (micro_step * world_size + rank) * micro_batch
    return rows_for_step(step, range(first, first + micro_batch), seq, vocab, seed)
