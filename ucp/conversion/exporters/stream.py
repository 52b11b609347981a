"""Reading the tensors to export in batches that fit a memory budget.

An export must not need the whole checkpoint in memory: tensors are read a batch
at a time, each batch holding at most ``budget`` bytes of tensors (a tensor larger
than the budget is read alone). A tensor's cost is its stored size, plus its
output size when it is cast (both copies exist for a moment). Reads go through
``ucp.loading.partial.read_targets``, which reads only the byte ranges of the batch's
tensors, assembling sharded tensors from their pieces and checking CRCs.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from reshard.box import Box
from ucp.conversion.exporters.selection import ExportTensor
from ucp.format.dtypes import itemsize
from ucp.format.manifest import Manifest
from ucp.format.regions import RawArray
from ucp.loading.partial import SourceIndex, Target, read_targets
from ucp.store.storage import Storage

DEFAULT_MEMORY_BUDGET = 512 << 20


def tensor_cost(t: ExportTensor) -> int:
    """Bytes held while ``t`` is in a batch."""
    return t.nbytes + (t.out_nbytes if t.cast else 0)


def plan_batches(costs: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive groups of indices whose costs sum to at most ``budget`` (an over-budget item alone)."""
    batches: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i, cost in enumerate(costs):
        if current and held + cost > budget:
            batches.append(current)
            current, held = [], 0
        current.append(i)
        held += cost
    if current:
        batches.append(current)
    return batches


def read_batches(
    storage: Storage,
    name: str,
    manifest: Manifest,
    tensors: Sequence[ExportTensor],
    *,
    budget: int = DEFAULT_MEMORY_BUDGET,
    verify: bool = True,
    raw: bool = False,
) -> Iterator[list[tuple[ExportTensor, Any]]]:
    """Yield the tensors, in the given order, as batches of (tensor, full contiguous value in its output dtype).

    ``raw``: a tensor that is not cast comes as a :class:`~ucp.format.regions.RawArray` of its stored bytes
    (the stored shape and item size) rather than a torch tensor, so an export without a cast imports
    neither torch nor numpy.

    A cast value is a view of a buffer reused by the next batch (:class:`CastArena`): it is valid until
    the next batch is asked for, so a consumer writes it before taking the value after the batch's last.
    """
    index = SourceIndex.of(manifest)  # shared by the batches: headers checked once
    arena = CastArena()
    batches = plan_batches([tensor_cost(t) for t in tensors], budget)
    for k, batch in enumerate(batches):
        chosen = [tensors[i] for i in batch]
        values = [_buffer(t, raw) for t in chosen]
        targets = [Target(t.name, v, Box.full(t.shape)) for t, v in zip(chosen, values) if t.entry.numel]
        read_targets(storage, name, manifest, targets, verify=verify, index=index)
        if k == len(batches) - 1:  # before the last batch goes out (a consumer may stop taking batches then):
            index.finish(storage, name)  # complete the checks of pieces checksummed span by span
        cast = arena.cast(chosen, values, budget)
        out = [(t, cast.get(i, v)) for i, (t, v) in enumerate(zip(chosen, values))]
        del values, targets, chosen, cast
        yield out  # consumers pop() from it: each tensor is freed as soon as it is written
        del out


class CastArena:
    """Where a batch's casts are written: one buffer, reused batch after batch.

    ``kernels.cast_flatten`` casts all the batch's tensors of one output dtype in one call, back to
    back into the buffer. Reusing the buffer is the gain: a fresh ``.to()`` result (or a fresh
    buffer) is memory the kernel maps page by page on first write, which costs more than the cast
    itself (tools/bench_cast_wiring.py, docs/benchmarks.md). The memory bound holds: the buffer is kept
    only while it and the batch's stored tensors fit the budget (or the batch's own cost), else it is
    replaced by one of the batch's size.
    """

    ALIGN = 64  # each output dtype's run starts at a multiple of this (any itemsize divides it)

    def __init__(self) -> None:
        self.buffer: Any = None  # torch.uint8 tensor, once a batch casts

    def cast(self, tensors: Sequence[ExportTensor], values: Sequence[Any], budget: int) -> dict[int, Any]:
        """``{index: value cast to its output dtype}`` for the cast tensors of one batch (views of the buffer)."""
        if not any(t.cast for t in tensors):
            return {}
        import torch

        import kernels

        # One run per (output dtype, by torch): fp16 -> fp32 stays torch's copy_, whose NaN bits the
        # kernel does not match in every position (kernels/cast.py).
        runs: dict[tuple[Any, bool], list[int]] = {}
        for i, t in enumerate(tensors):
            if t.cast:
                by_torch = t.dtype == torch.float16 and t.out_dtype == torch.float32
                runs.setdefault((t.out_dtype, by_torch), []).append(i)
        spans, need = [], 0
        for idx in runs.values():
            nbytes = sum(tensors[i].out_nbytes for i in idx)
            spans.append((need, nbytes))
            need += -(-nbytes // self.ALIGN) * self.ALIGN
        stored = sum(t.nbytes for t in tensors)
        limit = max(budget, sum(tensor_cost(t) for t in tensors))
        if self.buffer is None or self.buffer.numel() < need or self.buffer.numel() + stored > limit:
            self.buffer = None  # let the old one go before the new one is taken
            self.buffer = torch.empty(need, dtype=torch.uint8)
        out: dict[int, Any] = {}
        for ((dtype, by_torch), idx), (start, nbytes) in zip(runs.items(), spans):
            run = self.buffer[start : start + nbytes]
            if not by_torch:
                kernels.cast_flatten([values[i] for i in idx], run, dtype)
            flat, at = run.view(dtype), 0
            for i in idx:
                n = tensors[i].entry.numel
                out[i] = flat[at : at + n].view(tensors[i].shape)
                if by_torch:
                    out[i].copy_(values[i])
                at += n
        return out


def _buffer(t: ExportTensor, raw: bool) -> Any:
    """Where ``t`` is read to: its stored bytes (``raw`` and no cast), else a torch tensor of its stored dtype."""
    if raw and not t.cast:
        return RawArray.empty(t.shape, itemsize(t.entry.dtype))
    import torch

    return torch.empty(t.shape, dtype=t.dtype)


def one_by_one(
    batches: Iterator[list[tuple[ExportTensor, Any]]],
) -> Iterator[tuple[ExportTensor, Any]]:
    """The batches' items in order, each dropped from its batch as it is handed out (so memory frees early)."""
    for batch in batches:
        batch.reverse()
        while batch:
            yield batch.pop()
