"""Tensor-parallel building blocks (Megatron style) over a tp :class:`~training.comm.Comm`.

Two conjugate autograd functions carry all the communication:

* ``copy_to_tp``: identity forward, all-reduce (sum) of the gradient backward — placed where a
  replicated activation enters a column-parallel region (every rank's slice contributes to the
  input's gradient);
* ``reduce_from_tp``: all-reduce forward, identity backward — where partial results of a
  row-parallel product are summed.

Layers hold TP-local weights shaped as the layout's local buffers (so a ZeRO partition or a
checkpoint piece of them is what the layout says): column-parallel ``[out/tp, in]``, row-parallel
``[out, in/tp]``, vocabulary-parallel ``[padded_vocab/tp, d]``. At tp = 1 every collective is skipped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training.comm import Comm


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # autograd may hand the same tensor to other consumers
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _CopyToTP.apply(x, comm) if comm.active else x


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _ReduceFromTP.apply(x, comm) if comm.active else x


class ColumnParallelLinear(nn.Module):
    """``y_local = x W_localᵀ + b_local``: each rank computes its slice of the output features."""

    def __init__(self, in_features: int, out_local: int, bias: bool, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = Σ_ranks x_local W_localᵀ + b``: input features split, partial products summed; ``b`` replicated."""

    def __init__(self, in_local: int, out_features: int, bias: bool, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + local)`` of a (padded) vocabulary; also the tied output projection.

    Lookup: tokens outside this rank's rows read row 0 and are zeroed, then the partial embeddings
    are summed over tp. ``unembed=True``: logits for this rank's vocabulary slice (columns past the
    true vocabulary are padding, masked by :func:`vocab_parallel_cross_entropy`).
    """

    def __init__(self, local_rows: int, d_model: int, start: int, comm: Comm) -> None:
        super().__init__()
        self.comm, self.start = comm, start
        self.weight = nn.Parameter(torch.empty(local_rows, d_model))

    def forward(self, x: torch.Tensor, unembed: bool = False) -> torch.Tensor:
        if unembed:
            return F.linear(copy_to_tp(x, self.comm), self.weight)
        local = x - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        if self.comm.active:  # at tp = 1 every token is in range
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.comm)


class VocabParallelHead(nn.Module):
    """The untied output projection: logits for this rank's slice of the (padded) vocabulary."""

    def __init__(self, local_rows: int, d_model: int, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(local_rows, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.comm), self.weight)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross entropy over logits split by vocabulary over tp (fp32)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, vocab: int, comm: Comm
    ) -> torch.Tensor:
        n_local = logits.shape[-1]
        cols = torch.arange(start, start + n_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab, float("-inf"))  # padding columns never win
        top = logits.max(dim=-1).values
        comm.all_reduce(top, op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        sumexp = exp.sum(dim=-1)
        comm.all_reduce(sumexp)
        local_t = target - start
        mine = (local_t >= 0) & (local_t < n_local)
        idx = local_t.clamp(0, n_local - 1)
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        comm.all_reduce(picked)
        loss = sumexp.log() - picked
        exp.div_(sumexp.unsqueeze(-1))  # softmax
        ctx.save_for_backward(exp, idx, mine)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, idx, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, start: int, vocab: int, comm: Comm
) -> torch.Tensor:
    """Mean cross entropy of ``logits`` ``[..., local vocab]`` (this rank's columns from ``start``).

    Megatron's scheme: the max and the sum of exponentials are all-reduced over tp, and the target's
    logit is contributed by the rank holding it; nobody materialises the full vocabulary. Columns at
    or past ``vocab`` (padding) are excluded.
    """
    flat = logits.float().reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat, target.reshape(-1), start, vocab, comm).mean()
