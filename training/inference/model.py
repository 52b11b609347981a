"""What the executor needs of a model: its weight groups and three compute steps, plus the shared ops.

A model is a list of *groups* of tensor names: ``pre`` (embedding), one per transformer layer, and
``post`` (final norm, head). The executor makes each group's weights available (resident or streamed
through its ring) and calls :meth:`StreamModel.embed`, :meth:`StreamModel.layer` and
:meth:`StreamModel.head` with them. The KV cache and positions travel in a :class:`Step`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.nn.functional as F

from training.inference.errors import ModelConfigError
from training.inference.kvcache import KVCache
from training.inference.sources import WeightSource


@dataclass
class Step:
    """One forward pass: ``tokens`` [B, T] at cache slots ``[start, start + T)``.

    ``positions`` [B, T] are each row's RoPE positions (rows are left-padded to a common length),
    ``mask`` [B, start + T] marks the cache slots holding real tokens (False: padding); ``cache`` holds
    every layer's K/V (in memory or on disk).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    start: int
    cache: KVCache
    _rope: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def rope(self, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rope_tables` of this step's positions, computed once for all layers."""
        key = (head_dim, base)
        if key not in self._rope:
            self._rope[key] = rope_tables(self.positions, head_dim, base)
        return self._rope[key]

    def attn_mask(self) -> torch.Tensor:
        """[B, 1, T, start + T] booleans: a query sees real keys at or before its own slot."""
        t, total = self.tokens.shape[1], self.start + self.tokens.shape[1]
        q = torch.arange(self.start, total, device=self.mask.device).view(1, 1, t, 1)
        k = torch.arange(total, device=self.mask.device).view(1, 1, 1, total)
        # a padding query attends to itself only: a row with no key at all would give NaNs that its
        # values would carry into later layers' (masked, but 0 * NaN) products
        return ((k <= q) & self.mask[:, None, None, :total]) | (k == q)


class StreamModel(abc.ABC):
    """A decoder whose weights arrive group by group."""

    n_layers: int
    n_kv_heads: int
    head_dim: int

    @abc.abstractmethod
    def pre_names(self) -> list[str]: ...

    @abc.abstractmethod
    def layer_names(self, i: int) -> list[str]: ...

    @abc.abstractmethod
    def post_names(self) -> list[str]: ...

    def layer_stages(self, i: int) -> list[list[str]]:
        """Layer ``i``'s weights (``layer_names``, in that order) cut into *stages*, in the order
        :meth:`layer` reads them: once it reads a weight of a later stage it is done with every weight
        of the earlier ones (the executor then reuses their memory for weights read ahead). Default: one
        stage, the whole layer. A model cutting finer must read each weight through the mapping it is
        given, not keep a tensor across stages."""
        return [self.layer_names(i)]

    @abc.abstractmethod
    def expected_shapes(self) -> dict[str, tuple[int, ...]]: ...

    @abc.abstractmethod
    def embed(self, w: Mapping[str, torch.Tensor], step: Step) -> torch.Tensor: ...

    @abc.abstractmethod
    def layer(self, i: int, w: Mapping[str, torch.Tensor], h: torch.Tensor, step: Step) -> torch.Tensor: ...

    @abc.abstractmethod
    def head(self, w: Mapping[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor: ...

    def check_weights(self, source: WeightSource) -> None:
        """Every tensor the config implies is present with the config's shape (named errors otherwise)."""
        for name, shape in self.expected_shapes().items():
            if name not in source:
                raise ModelConfigError(
                    f"{source.root}: tensor {name!r} (shape {list(shape)}) is missing from the weights"
                )
            got = source[name].shape
            if tuple(got) != tuple(shape):
                where = source[name].runs[0].file if source[name].runs else source.root
                raise ModelConfigError(
                    f"{where}: tensor {name!r} has shape {list(got)}, the model config implies {list(shape)}"
                )


def cut_before(names: list[str], cuts: list[str]) -> list[list[str]]:
    """``names`` split into runs, a new one starting at each name ending with one of ``cuts``."""
    out: list[list[str]] = []
    for n in names:
        if not out or any(n.endswith(c) for c in cuts):
            out.append([])
        out[-1].append(n)
    return out


def rope_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] for rotate-half RoPE, computed as transformers' Llama computes them."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = (inv[None, :, None] @ positions[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def attend(
    i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, scale: float | None = None
) -> torch.Tensor:
    """Write k, v [B, kv, T, hd] into layer ``i``'s cache at ``step.start`` and attend q [B, H, T, hd]
    over the cache so far (GQA: each kv head serves H // kv consecutive query heads). The cache is
    token-major ([slots, B, kv, hd]), whether in memory or on disk, so both run these same ops."""
    t = q.shape[2]
    end = step.start + t
    with step.cache.layer(i, step.start, end) as (kc, vc):
        kc[step.start : end] = k.permute(2, 0, 1, 3)
        vc[step.start : end] = v.permute(2, 0, 1, 3)
        keys, values = kc[:end].permute(1, 2, 0, 3), vc[:end].permute(1, 2, 0, 3)
        groups = q.shape[1] // keys.shape[1]
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=step.attn_mask(), scale=scale)
