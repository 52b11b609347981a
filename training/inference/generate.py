"""Generation: a batch of prompts, prefill then decode, greedy or sampled; KV cache in memory, or on
disk when it exceeds ``kv_budget`` (:mod:`training.inference.kvcache`).

Prompts of different lengths are left-padded to a common length: every row writes the same cache
slot at each step, its RoPE positions count only its real tokens, and padding slots are masked out,
so a row's tokens do not depend on the other rows of its batch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field

from training.inference.errors import InferenceError
from training.inference.executor import Executor
from training.inference.kvcache import KVCache, KVStats, make_cache
from training.inference.model import Step


class Sampling(BaseModel):
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0


def next_tokens(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> torch.Tensor:
    """[B] token ids from last-position logits [B, vocab]."""
    if sampling.temperature == 0.0:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scores, min(sampling.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        probs = sorted_scores.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=gen).squeeze(-1)


@dataclass
class Generated:
    """Token ids per prompt (new tokens only) and the timings of the run."""

    tokens: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    batch: int
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when asked for
    kv: KVStats = field(default_factory=KVStats)


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] and mask [B, T] of left-padded prompts."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InferenceError("every prompt needs at least one token")
    t = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), t), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, t - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, t - len(p) :] = True
    return tokens, mask


def generate(
    ex: Executor,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    *,
    keep_logits: bool = False,
    vocab_size: int | None = None,
    on_token: Callable[[int], None] | None = None,
    kv_budget: int | None = None,
    kv_dir: str | os.PathLike[str] | None = None,
) -> Generated:
    """Generate ``max_new_tokens`` for each prompt in one batch: one prefill pass, then one pass per token
    (``on_token(n)`` after the n-th token of every row). The KV cache stays in memory unless it needs
    more than ``kv_budget`` bytes; then it lives in a temporary file under ``kv_dir`` (default: the
    system's temporary directory), ``kv_budget`` bytes of layer blocks read ahead."""
    sampling = sampling or Sampling()
    if max_new_tokens < 1:
        raise InferenceError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if vocab_size is not None:
        for i, p in enumerate(prompts):
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise InferenceError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    gen = torch.Generator().manual_seed(sampling.seed)
    tokens, mask = left_pad(prompts)
    b, t = tokens.shape
    total = t + max_new_tokens
    m = ex.model
    with make_cache(
        m.n_layers,
        b,
        m.n_kv_heads,
        m.head_dim,
        total,
        ex.dtype,
        budget=kv_budget,
        directory=kv_dir,
        device=None if ex.read_path == "cpu" else ex.device,
    ) as cache:
        g = _run(ex, tokens, mask, max_new_tokens, sampling, gen, cache, keep_logits, on_token)
    g.kv = cache.stats
    return g


def _run(
    ex: Executor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    gen: torch.Generator,
    cache: KVCache,
    keep_logits: bool,
    on_token: Callable[[int], None] | None,
) -> Generated:
    b, t = tokens.shape
    total = t + max_new_tokens
    dev = ex.device
    full_mask = torch.ones((b, total), dtype=torch.bool)
    full_mask[:, :t] = mask
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    tokens, full_mask, positions = tokens.to(dev), full_mask.to(dev), positions.to(dev)
    out: list[list[int]] = [[] for _ in range(b)]
    kept: list[torch.Tensor] = []
    t0 = time.perf_counter()
    logits = ex.forward(Step(tokens, positions, full_mask, 0, cache))
    if keep_logits:
        kept.append(logits.cpu())
    nxt = next_tokens(logits[:, -1].cpu(), sampling, gen)  # sampled on the CPU, by one generator, on any device
    prefill = time.perf_counter() - t0
    last = positions[:, -1]
    t1 = time.perf_counter()
    for s in range(max_new_tokens):
        for i in range(b):
            out[i].append(int(nxt[i]))
        if on_token is not None:
            on_token(s + 1)
        if s == max_new_tokens - 1:
            break
        last = last + 1
        logits = ex.forward(Step(nxt[:, None].to(dev), last[:, None], full_mask, t + s, cache))
        if keep_logits:
            kept.append(logits.cpu())
        nxt = next_tokens(logits[:, -1].cpu(), sampling, gen)
    decode = time.perf_counter() - t1
    return Generated(out, prefill, decode, max_new_tokens - 1, b, kept)
