"""ZeRO-3: parameters live as flat partitions and are gathered per module only while needed.

Lifecycle of a parameter (one ``all_gather`` over dp per gather):

* forward: a module's forward pre-hook gathers its own (direct) parameters and prefetches the next
  module's in the order recorded on the first pass; its forward post-hook releases them
  (``param.data`` becomes an empty tensor);
* autograd would keep every gathered weight alive until backward through the tensors it saves
  (``weight.t()`` and the like). A ``saved_tensors_hooks`` pair replaces a saved view of a gathered
  parameter by (param, size, stride, offset) and rebuilds the view from a fresh gather on unpack;
* backward: a hook on the module's outputs fires when their gradient is ready, i.e. before any of
  the module's backward runs: it gathers the module's parameters again (AccumulateGrad needs the
  full shape) and prefetches the next module in the recorded backward order. Each parameter is
  released by the optimizer once its gradient has been reduce-scattered.

Every dp rank runs the same graph, so gathers (and prefetches, decided from the same recorded
order) are issued in the same order everywhere, as collectives require.

With a partition *source* (parameters on NVMe, :mod:`training.offload.params`), each gather takes its
input from the source instead of a view of the partition buffer, and every module visit (and the start
of each pass) asks the source to read ahead the partitions of the modules that follow in the recorded
order, as far as its buffer budget goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from training.comm import Comm


@dataclass
class _Packed:
    """A saved view of a gathered parameter, to rebuild after gathering it again."""

    param: nn.Parameter
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class PartitionSource(Protocol):
    """Where a gather's input partition comes from when it is not kept in memory (parameters on NVMe)."""

    def partition(self, p: nn.Parameter) -> torch.Tensor: ...

    def read_ahead(self, params: Iterable[nn.Parameter]) -> None: ...

    def drop(self) -> None: ...


class _Trace:
    """The order modules were visited in on the first pass; prefetch follows it while it holds."""

    def __init__(self) -> None:
        self.order: list[nn.Module] = []
        self.recording = True
        self.valid = True
        self.pos = 0

    def begin(self) -> None:
        if self.recording and self.order:
            self.recording = False
        self.pos = 0

    def visit(self, m: nn.Module) -> nn.Module | None:
        """Note a visit; returns the module expected next (to prefetch), if known."""
        if self.recording:
            if not self.order or self.order[-1] is not m:
                self.order.append(m)
            return None
        if not self.valid:
            return None
        if self.pos < len(self.order) and self.order[self.pos] is m:
            self.pos += 1
        elif self.pos > 0 and self.order[self.pos - 1] is m:
            pass  # the same module again (several outputs)
        else:
            self.valid = False  # the graph changed: stop guessing
            return None
        return self.order[self.pos] if self.pos < len(self.order) else None

    def upcoming(self) -> list[nn.Module]:
        """The modules the recorded order expects from here on (none while recording or after it broke)."""
        return [] if self.recording or not self.valid else self.order[self.pos :]


class ParamGatherer:
    """Gathers and releases the partitioned parameters of ``module`` around its submodules' use.

    ``params[param] = (local shape, this rank's flat partition, padded size D·p)``; ``source``: where the
    partitions come from instead (the partition views are then unused).
    """

    def __init__(
        self,
        module: nn.Module,
        params: dict[nn.Parameter, tuple[tuple[int, ...], torch.Tensor, int]],
        dp: Comm,
        prefetch: bool = True,
        source: PartitionSource | None = None,
    ) -> None:
        self.dp = dp
        self.source = source
        self.params = params  # param -> (local shape, partition view, padded numel D·p)
        self.prefetch = prefetch
        self.full: dict[nn.Parameter, torch.Tensor] = {}  # gathered 1-d buffers
        self.inflight: dict[nn.Parameter, tuple[torch.Tensor, Any, torch.Tensor]] = {}  # buffer, work, input
        self.by_storage: dict[int, nn.Parameter] = {}
        self.modules = [m for m in module.modules() if any(p in params for p in m.parameters(recurse=False))]
        self.fwd, self.bwd = _Trace(), _Trace()
        self.gathers = 0  # all_gathers issued (for tests and stats)
        self.prefetched = 0  # of those, issued ahead of use (the next module in the recorded order)
        self.packed = 0  # saved tensors replaced by a reference to a gathered parameter
        self._handles = []
        for m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward))
        for p in params:  # the optimizer copied the partitions out: drop the full local tensors
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    # -- gathering -----------------------------------------------------------------------------
    def _own(self, m: nn.Module) -> list[nn.Parameter]:
        return [p for p in m.parameters(recurse=False) if p in self.params]

    def _launch(self, p: nn.Parameter) -> None:
        if p in self.full or p in self.inflight:
            return
        _, part, padded = self.params[p]
        if self.source is not None:
            part = self.source.partition(p)
        buf = torch.empty(padded, dtype=part.dtype, device=part.device)
        self.inflight[p] = (buf, self.dp.all_gather(buf, part, async_op=True), part)  # the input lives until waited
        self.gathers += 1

    def _finish(self, p: nn.Parameter) -> None:
        if p in self.full:
            return
        if p not in self.inflight:
            self._launch(p)
        buf, work, _ = self.inflight.pop(p)
        work.wait()
        shape = self.params[p][0]
        n = math.prod(shape)
        self.full[p] = buf
        self.by_storage[buf.untyped_storage().data_ptr()] = p
        p.data = buf[:n].view(shape)

    def fetch(self, m: nn.Module) -> None:
        own = self._own(m)
        for p in own:
            self._launch(p)
        for p in own:
            self._finish(p)

    def _prefetch(self, m: nn.Module | None) -> None:
        if self.prefetch and m is not None:
            for p in self._own(m):
                if p not in self.full and p not in self.inflight:
                    self._launch(p)
                    self.prefetched += 1

    def release(self, p: nn.Parameter) -> None:
        buf = self.full.pop(p, None)
        if buf is not None:
            self.by_storage.pop(buf.untyped_storage().data_ptr(), None)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def release_all(self) -> None:
        """Drop every gathered or prefetched parameter (end of a backward pass)."""
        for _, work, _ in list(self.inflight.values()):
            work.wait()
        self.inflight.clear()
        for p in list(self.full):
            self.release(p)

    def reset(self) -> None:
        """After an aborted pass: drop gathers in flight (not waited for: see ZeroOptimizer.reset) and
        every gathered parameter, and record the visit order again if the first pass did not finish."""
        self.inflight.clear()
        for p in list(self.full):
            self.release(p)
        if self.source is not None:
            self.source.drop()
        for trace in (self.fwd, self.bwd):
            if trace.recording:
                trace.order.clear()

    # -- hooks ---------------------------------------------------------------------------------
    def _read_ahead(self, trace: _Trace) -> None:
        """Ask the source to read ahead what the recorded order needs next (not what is gathered or in flight)."""
        if self.source is not None:
            upcoming = trace.upcoming()
            if upcoming:
                own = (p for m in upcoming for p in self._own(m))
                self.source.read_ahead(p for p in own if p not in self.full and p not in self.inflight)

    def _pre_forward(self, m: nn.Module, args: Any) -> None:
        self.fetch(m)
        self._prefetch(self.fwd.visit(m))
        self._read_ahead(self.fwd)

    def _post_forward(self, m: nn.Module, args: Any, out: Any) -> None:
        for p in self._own(m):
            self.release(p)
        if torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._make_pre_backward(m))

    def _make_pre_backward(self, m: nn.Module) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.fetch(m)
            self._prefetch(self.bwd.visit(m))
            self._read_ahead(self.bwd)

        return hook

    def begin_forward(self) -> None:
        self.fwd.begin()
        self._read_ahead(self.fwd)

    def begin_backward(self) -> None:
        self.bwd.begin()
        self._read_ahead(self.bwd)

    # -- saved tensors -------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if not self.by_storage or t.device.type == "meta":
            return t
        p = self.by_storage.get(t.untyped_storage().data_ptr())
        if p is None:
            return t
        self.packed += 1
        return _Packed(p, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    def _unpack(self, obj: Any) -> torch.Tensor:
        if not isinstance(obj, _Packed):
            return obj
        self._finish(obj.param)
        return torch.as_strided(self.full[obj.param], obj.size, obj.stride, obj.offset)

    def saved_tensors(self) -> Any:
        """Context manager for forward passes: saved parameter views become references (see module doc)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def gathered(self) -> Iterator[nn.Parameter]:
        yield from self.full

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
