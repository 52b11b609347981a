"""Pipeline schedules over point-to-point send/recv: GPipe and 1F1B.

Stage s receives a micro-batch's input activations from stage s-1 (same tp and dp index), sends
its outputs to s+1, and in backward receives the outputs' gradient from s+1 and sends its inputs'
gradient to s-1. Sends and receives between two stages happen in the same order on both sides
(FIFO per direction), so they match without tags.

* **GPipe**: all forwards, then all backwards. Simple; holds the activations of every micro-batch.
* **1F1B** (PipeDream-flush, as Megatron): stage s runs ``pp - s - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards. At most
  ``pp - s`` micro-batches' activations are alive at once. Where a stage must send one way and
  receive the other at the same time, both are posted together (``batch_isend_irecv``) before
  waiting, which is what keeps neighbouring stages from waiting on each other's send.

Both produce the same gradients (accumulated over all micro-batches before the optimizer step).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from training.mesh import ParallelMesh
from training.zero import ZeroOptimizer


class _Stage:
    """One stage's forward/backward of micro-batch m, and its point-to-point exchanges."""

    def __init__(
        self,
        model: torch.nn.Module,
        opt: ZeroOptimizer,
        mesh: ParallelMesh,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        act_shape: Sequence[int],
        act_dtype: torch.dtype,
        on_loss: Callable[[torch.Tensor], None],
        device: torch.device | str,
    ) -> None:
        self.model, self.opt, self.batches, self.on_loss = model, opt, batches, on_loss
        self.first, self.last = mesh.first_stage, mesh.last_stage
        self.prev = mesh.stage_rank(mesh.coord.pp - 1) if not self.first else -1
        self.next = mesh.stage_rank(mesh.coord.pp + 1) if not self.last else -1
        self.shape, self.dtype, self.device = tuple(act_shape), act_dtype, device
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _buf(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def exchange(self, send: list[tuple[torch.Tensor, int]], recv: list[int]) -> list[torch.Tensor]:
        """Post every send and receive together, then wait for all; returns the received tensors."""
        bufs = [self._buf() for _ in recv]
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in send]
        ops += [dist.P2POp(dist.irecv, b, peer) for b, peer in zip(bufs, recv)]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return bufs

    def forward(self, m: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """Forward micro-batch m; returns the activation to send on (None on the last stage)."""
        tokens, targets = self.batches[m]
        if self.first:
            x = tokens
        else:
            assert x is not None
            x.requires_grad_()
        with self.opt.forward_context():
            y = self.model(x, targets if self.last else None)
        self.inputs[m], self.outputs[m] = x, y
        if self.last:
            self.on_loss(y.detach())
            return None
        return y.detach()

    def backward(self, m: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward micro-batch m; returns its input's gradient to send back (None on the first stage)."""
        y, x = self.outputs.pop(m), self.inputs.pop(m)
        if self.last:
            self.opt.backward(y)
        else:
            self.opt.backward(y, grad)
        return None if self.first else x.grad


def gpipe(
    model: torch.nn.Module,
    opt: ZeroOptimizer,
    mesh: ParallelMesh,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    act_shape: Sequence[int],
    act_dtype: torch.dtype,
    on_loss: Callable[[torch.Tensor], None],
    device: torch.device | str = "cpu",
) -> None:
    """All forwards, then all backwards (last micro-batch first)."""
    st = _Stage(model, opt, mesh, batches, act_shape, act_dtype, on_loss, device)
    for m in range(len(batches)):
        x = None if st.first else st.exchange([], [st.prev])[0]
        y = st.forward(m, x)
        if y is not None:
            st.exchange([(y, st.next)], [])
    for m in reversed(range(len(batches))):
        g = None if st.last else st.exchange([], [st.next])[0]
        gx = st.backward(m, g)
        if gx is not None:
            st.exchange([(gx, st.prev)], [])


def one_f_one_b(
    model: torch.nn.Module,
    opt: ZeroOptimizer,
    mesh: ParallelMesh,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    act_shape: Sequence[int],
    act_dtype: torch.dtype,
    on_loss: Callable[[torch.Tensor], None],
    device: torch.device | str = "cpu",
) -> None:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards (module doc)."""
    st = _Stage(model, opt, mesh, batches, act_shape, act_dtype, on_loss, device)
    M = len(batches)
    warmup = min(mesh.pp - mesh.coord.pp - 1, M)
    steady = M - warmup
    recv_prev = [] if st.first else [st.prev]
    recv_next = [] if st.last else [st.next]

    def send_to(t: torch.Tensor | None, peer: int) -> list[tuple[torch.Tensor, int]]:
        return [] if t is None else [(t, peer)]

    for m in range(warmup):
        x = st.exchange([], recv_prev)
        y = st.forward(m, x[0] if x else None)
        st.exchange(send_to(y, st.next), [])
    x = st.exchange([], recv_prev) if steady else []
    for i in range(steady):
        fwd, bwd = warmup + i, i
        y = st.forward(fwd, x[0] if x else None)
        g = st.exchange(send_to(y, st.next), recv_next)  # send this output, get the oldest's gradient
        gx = st.backward(bwd, g[0] if g else None)
        if i == steady - 1:
            st.exchange(send_to(gx, st.prev), [])
        else:
            x = st.exchange(send_to(gx, st.prev), recv_prev)  # send a gradient back, get the next input
    for bwd in range(steady, M):
        g = st.exchange([], recv_next)
        gx = st.backward(bwd, g[0] if g else None)
        st.exchange(send_to(gx, st.prev), [])


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
