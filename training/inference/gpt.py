"""The reference GPT of :mod:`training.models.gpt`, run group by group with a KV cache.

Same arithmetic as ``training.models.gpt.GPT`` (pre-LayerNorm, fused QKV, rotate-half RoPE, GELU or
fused SwiGLU, tied or untied head), with RoPE at each token's cache position.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from training.inference.model import Step, StreamModel, apply_rope, attend, cut_before
from training.models.gpt import GPTConfig, expected_param_shapes


class StreamGPT(StreamModel):
    def __init__(self, cfg: GPTConfig) -> None:
        self.cfg = cfg
        self.n_layers = cfg.n_layer
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self._shapes = expected_param_shapes(cfg)

    def pre_names(self) -> list[str]:
        return ["embed.weight"]

    def layer_names(self, i: int) -> list[str]:
        return [n for n in self._shapes if n.startswith(f"layers.{i}.")]

    def post_names(self) -> list[str]:
        return ["ln_f.weight", "ln_f.bias", "embed.weight" if self.cfg.tied_embeddings else "head.weight"]

    def layer_stages(self, i: int) -> list[list[str]]:
        """[ln1, qkv], [proj, ln2], [fc1], [fc2] (biases with their weights), the order :meth:`layer` reads them."""
        return cut_before(self.layer_names(i), [".attn.proj.weight", ".mlp.fc1.weight", ".mlp.fc2.weight"])

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def embed(self, w: Mapping[str, torch.Tensor], step: Step) -> torch.Tensor:
        if step.start + step.tokens.shape[1] > self.cfg.max_seq:
            raise ValueError(f"sequence length {step.start + step.tokens.shape[1]} exceeds max_seq={self.cfg.max_seq}")
        return F.embedding(step.tokens, w["embed.weight"])

    def layer(self, i: int, w: Mapping[str, torch.Tensor], h: torch.Tensor, step: Step) -> torch.Tensor:
        cfg, p = self.cfg, f"layers.{i}."
        b, t, d = h.shape
        hd, nq, nkv = cfg.head_dim, cfg.n_head, cfg.kv_heads

        def lin(name: str, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, w[f"{p}{name}.weight"], w.get(f"{p}{name}.bias"))

        x = F.layer_norm(h, (d,), w[p + "ln1.weight"], w[p + "ln1.bias"])
        q, k, v = lin("attn.qkv", x).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        cos, sin = step.rope(hd, cfg.rope_base)
        q = apply_rope(q.view(b, t, nq, hd).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, t, nkv, hd).transpose(1, 2), cos, sin)
        y = attend(i, q, k, v.view(b, t, nkv, hd).transpose(1, 2), step)
        h = h + lin("attn.proj", y.transpose(1, 2).reshape(b, t, nq * hd))
        x = lin("mlp.fc1", F.layer_norm(h, (d,), w[p + "ln2.weight"], w[p + "ln2.bias"]))
        if cfg.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x, approximate="tanh")
        return h + lin("mlp.fc2", x)

    def head(self, w: Mapping[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(h, (h.shape[-1],), w["ln_f.weight"], w["ln_f.bias"])
        return F.linear(h, w["embed.weight" if self.cfg.tied_embeddings else "head.weight"])
