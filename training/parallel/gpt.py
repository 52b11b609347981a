"""The reference GPT as one pipeline stage of a tensor-parallel model.

``ParallelGPT`` mirrors ``training.models.gpt.GPT`` module for module, so its parameter names are
the global ones (``layers.3.attn.qkv.weight``: layers live in a ModuleDict keyed by the global
layer index) and its registration order is the global order restricted to the stage. Each
parameter's local shape is the layout's local buffer for this rank, and :func:`build_stage`
fills it by copying the layout's slots out of the single-process model's tensors, so a
TP × PP × DP run starts from exactly the weights of ``GPT(cfg, seed)``.

Layers: fused QKV column-parallel (this rank's q, k and v heads: ``[q_t; k_t; v_t]``, so GQA works
as long as tp divides the kv heads), attention output row-parallel, fc1 column-parallel (SwiGLU:
``[gate_t; up_t]``), fc2 row-parallel, embedding and head vocabulary-parallel.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from reshard import RankView
from training.comm import Comm
from training.models.gpt import GPTConfig, _rope

from .tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_parallel_cross_entropy,
)


def _local(view: RankView, name: str, dim: int) -> int:
    return view.tensors[name].shape[dim]


class ParallelAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, view: RankView, prefix: str, comm: Comm) -> None:
        super().__init__()
        tp = comm.size
        if cfg.n_head % tp or cfg.kv_heads % tp:
            raise ValueError(f"tp={tp} must divide n_head={cfg.n_head} and n_kv_head={cfg.kv_heads}")
        self.cfg, self.nq, self.nkv = cfg, cfg.n_head // tp, cfg.kv_heads // tp
        hd = cfg.head_dim
        rows = _local(view, prefix + "qkv.weight", 0)
        assert rows == (self.nq + 2 * self.nkv) * hd, (rows, self.nq, self.nkv)
        self.qkv = ColumnParallelLinear(cfg.d_model, rows, cfg.bias, comm)
        self.proj = RowParallelLinear(self.nq * hd, cfg.d_model, cfg.bias, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (b, t, _), hd, nq, nkv = x.shape, self.cfg.head_dim, self.nq, self.nkv
        q, k, v = self.qkv(x).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q = _rope(q.view(b, t, nq, hd).transpose(1, 2), self.cfg.rope_base)
        k = _rope(k.view(b, t, nkv, hd).transpose(1, 2), self.cfg.rope_base)
        v = v.view(b, t, nkv, hd).transpose(1, 2)
        if nkv != nq:  # GQA: this rank's kv heads serve its query heads, n_head // n_kv_head each
            k = k.repeat_interleave(nq // nkv, dim=1)
            v = v.repeat_interleave(nq // nkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, nq * hd))


class ParallelMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, view: RankView, prefix: str, comm: Comm) -> None:
        super().__init__()
        self.swiglu = cfg.swiglu
        rows = _local(view, prefix + "fc1.weight", 0)
        self.fc1 = ColumnParallelLinear(cfg.d_model, rows, cfg.bias, comm)
        self.fc2 = RowParallelLinear(_local(view, prefix + "fc2.weight", 1), cfg.d_model, cfg.bias, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)  # this rank's [gate_t; up_t]
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)


class ParallelBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, view: RankView, i: int, comm: Comm) -> None:
        super().__init__()
        p = f"layers.{i}."
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = ParallelAttention(cfg, view, p + "attn.", comm)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = ParallelMLP(cfg, view, p + "mlp.", comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelGPT(nn.Module):
    """One pipeline stage: the embedding (first stage, or last when tied), its layers, ln_f and head (last).

    ``forward(x, targets)``: ``x`` is tokens on the first stage, else the previous stage's hidden
    states; the last stage returns the mean loss (or logits for this rank's vocabulary slice when
    ``targets`` is None), the others their hidden states.
    """

    def __init__(self, cfg: GPTConfig, view: RankView, comm: Comm, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.cfg, self.comm, self.first, self.last = cfg, comm, first, last
        held = view.tensors
        self.embed: VocabParallelEmbedding | None = None
        if "embed.weight" in held:
            rows = held["embed.weight"].shape[0]
            self.embed = VocabParallelEmbedding(rows, cfg.d_model, comm.index * rows, comm)
        self.layers = nn.ModuleDict({str(i): ParallelBlock(cfg, view, i, comm) for i in layers})
        self.ln_f = nn.LayerNorm(cfg.d_model) if last else None
        self.head: VocabParallelHead | None = None
        if last and not cfg.tied_embeddings:
            self.head = VocabParallelHead(held["head.weight"].shape[0], cfg.d_model, comm)
        out = self.head if self.head is not None else self.embed
        # first vocabulary row (logit column) of this rank: embedding and head are padded alike
        self.vocab_start = comm.index * out.weight.shape[0] if out is not None else 0

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x) if self.first else x  # type: ignore[misc]
        for layer in self.layers.values():
            h = layer(h)
        if not self.last:
            return h
        assert self.ln_f is not None
        h = self.ln_f(h)
        logits = self.embed(h, unembed=True) if self.head is None else self.head(h)  # type: ignore[misc]
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.cfg.vocab_size, self.comm)


@torch.no_grad()
def fill_from_global(module: nn.Module, view: RankView, global_tensors: Mapping[str, torch.Tensor]) -> None:
    """Set every parameter to this rank's part of the global tensors, as the layout's slots say (padding: 0)."""
    for name, p in module.named_parameters():
        buf = view.tensors[name]
        local = torch.zeros(buf.shape, dtype=p.dtype)
        src = global_tensors[name]
        for s in buf.slots:
            local[s.local.slices()] = src[s.glob.slices()]  # type: ignore[union-attr]
        p.copy_(local)


def build_stage(
    cfg: GPTConfig, view: RankView, comm: Comm, layers: list[int], first: bool, last: bool, seed: int
) -> ParallelGPT:
    """This rank's stage of the TP model, initialised from ``GPT(cfg, seed)`` (built here in full, then sliced)."""
    from training.models.gpt import GPT

    module = ParallelGPT(cfg, view, comm, layers, first, last)
    reference = GPT(cfg, seed=seed)
    fill_from_global(module, view, dict(reference.named_parameters()))
    return module
