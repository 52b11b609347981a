"""ZeRO stages 0-3 with Adam/AdamW over flat fp32 partitions, on torch.distributed.

What each stage keeps per rank (D = data-parallel ranks, Ψ = parameters of the TP-local model):

=========  ==========================  ==========================  ===================================
stage      compute weights             gradients (fp32)            fp32 master, exp_avg, exp_avg_sq
=========  ==========================  ==========================  ===================================
0          all (flat, per group)       all; all-reduced per step   all (no partitioning; DDP-like)
1          all                         all; all-reduced per step   1/D partition
2          all                         1/D: reduced to their owner 1/D partition
                                       per micro-batch, in buckets
3          1/D, gathered per module    1/D: reduce-scattered per   1/D partition
           (training.zero.stage3)      parameter as it is ready
=========  ==========================  ==========================  ===================================

Gradients are averaged over dp and micro-batches (``1/(D·M)``, with the fp16 loss scale divided out
in the same multiply) in fp32, clipped by the global norm (each global element counted once, on
the rank whose slot of it has replica 0), then every rank runs Adam on its partition and the
updated weights are cast to the compute dtype and all-gathered (stages 1/2) or kept as the
partition (stage 3).

The partition layout is the checkpoint layout's (training.zero.groups); :meth:`ZeroOptimizer.buffers`
pairs every buffer the resolved layout describes with the tensor that holds it, which is what the
checkpoint seam (training.checkpoint) turns into ucp pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from reshard import Layout, LocalBuffer, RankView
from training.adam import AdamConfig, adam_update
from training.comm import Comm, _Done
from training.offload import OffloadConfig, OptimizerOffload
from training.offload.pages import release_zeroed
from training.offload.params import ParamTier
from training.offload.store import SubGroup

from .groups import GroupPlan
from .loss_scale import DynamicLossScaler
from .stage3 import ParamGatherer

STATE_KEYS = ("fp32_master", "exp_avg", "exp_avg_sq")


@dataclass
class _Pending:
    """A gradient reduction in flight: stage 2 (``key`` = owner rank of a bucket) or 3 (``key`` = member index)."""

    group: int
    key: int
    out: torch.Tensor  # the bucket (stage 2) / this rank's reduced partition (stage 3)
    work: Any
    keep: torch.Tensor | None = None  # the send buffer, alive until the collective completes


@dataclass
class _Early:
    """An offloaded update armed for the step's last backward (:meth:`ZeroOptimizer.prepare_step`)."""

    scale: float  # step()'s gradient scale
    casts: list[torch.Tensor | None]  # where the update writes each group's compute-dtype weights
    members: dict[tuple[int, int], list[int]]  # (group, member) -> the sub-groups it overlaps
    waiting: list[int]  # per sub-group: members whose gradient is not final yet (0: handed over)
    ranges: dict[tuple[int, int], list[int]]  # (group, member) -> indices of its ranges in _counted[group]
    final: set[tuple[int, int]] = field(default_factory=set)  # members whose gradient is final (and scaled)
    norm_terms: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (group, range) -> sum of squares
    # Direct (the armed pass is the step's only one, so the accumulation buffer holds zeros): each member's
    # reduced gradient is kept as it came (scaled) instead of being added into ``grad_acc``, and a sub-group's
    # gradient is gathered from them into one reused buffer when the tier updates it. Why: ``grad_acc``'s
    # pages then stay given back; adding into them faulted 4 KiB pages back in, ~0.4 s a step for 400 MB.
    direct: bool = False
    outs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (group, member) -> its gradient
    left: dict[tuple[int, int], int] = field(default_factory=dict)  # (group, member) -> its sub-groups not updated


NORM_CHUNK = 1 << 20  # elements per float64 temporary of an armed step's norm terms (8 MiB)


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """Σ x² in float64, a chunk at a time: the term of :meth:`ZeroOptimizer._global_norm`, without its whole
    float64 copy (an armed step takes it during backward, when the activations are still held). The sum is
    ordered differently, so the reported norm may differ from an unarmed step's in the last bits; armed
    steps never clip, so the update does not use it."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for lo in range(0, x.numel(), NORM_CHUNK):
        total += x[lo : lo + NORM_CHUNK].double().pow(2).sum()
    return total


def _finished(work: Any) -> bool:
    """Whether a collective's work handle has completed (a handle without ``is_completed`` is done)."""
    check = getattr(work, "is_completed", None)
    return True if check is None else bool(check())


class ZeroOptimizer:
    """Owns a module's parameters' optimizer state (and at stage 3 the parameters) as flat partitions.

    ``module``: the TP-local module; its ``named_parameters()`` must list exactly the tensors
    ``view`` (this rank's resolved layout) holds, in the same order. ``dp``: the data-parallel group,
    ``world``: the group a global reduction (gradient norm, overflow) spans, ``tied``: names whose
    gradients are summed over ``tied_comm`` first (a tied embedding on the first and last pipeline
    stage). ``group_weight_decay[g]`` overrides the config's weight decay for layout group ``g``.
    ``offload``: with ``offload_optimizer.device`` cpu or nvme, the fp32 masters and Adam moments live
    in that tier (training.offload) instead of :attr:`master` / :attr:`exp_avg` / :attr:`exp_avg_sq`,
    which then stay empty (checkpoints stage them: :meth:`buffers`); call :meth:`close` to remove its swap files.
    With ``offload_param.device`` nvme (stage 3), the compute-dtype partitions live in swap files too
    (training.offload.params, :attr:`param_tier`) and :attr:`param_part` stays empty.
    """

    def __init__(
        self,
        module: nn.Module,
        layout: Layout,
        view: RankView,
        *,
        dp: Comm,
        world: Comm,
        adam: AdamConfig,
        dtype: torch.dtype = torch.float32,
        clip: float | None = None,
        group_weight_decay: Sequence[float | None] | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        tied: Iterable[str] = (),
        tied_comm: Comm | None = None,
        prefetch: bool = True,
        offload: OffloadConfig | None = None,
    ) -> None:
        self.module, self.layout, self.view = module, layout, view
        self.stage = layout.zero.stage
        self.dp, self.world, self.adam, self.dtype, self.clip = dp, world, adam, dtype, clip
        self.scaler = loss_scaler
        self.tied = [n for n in tied if n in view.tensors]  # middle pipeline stages hold none of them
        self.tied_comm = tied_comm or Comm.solo()
        if self.tied and self.tied_comm.active and self.stage >= 2:
            raise ValueError("a tied tensor shared between pipeline stages needs ZeRO stage 0 or 1")
        self.params: dict[str, nn.Parameter] = dict(module.named_parameters())
        self.device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        held = list(view.tensors)
        if list(self.params) != held:
            raise ValueError(
                f"the module's parameters {_preview(self.params)} differ from what the layout puts "
                f"on rank {view.rank} {_preview(held)} (names and order must match)"
            )
        for n, p in self.params.items():
            if not p.requires_grad:
                raise ValueError(f"parameter {n!r} does not require grad: frozen parameters are not supported")
            if tuple(p.shape) != view.tensors[n].shape:
                raise ValueError(
                    f"parameter {n!r}: the module holds {list(p.shape)}, the layout "
                    f"{list(view.tensors[n].shape)} on rank {view.rank}"
                )
        zero = layout.zero
        groups: list[list[str]] = [[] for _ in zero.groups]
        for n in self.params:
            g = zero.group_of(n)
            if g is None:
                raise ValueError(
                    f"parameter {n!r} is in no ZeRO group of the layout {zero.groups}: "
                    "frozen parameters are not supported"
                )
            groups[g].append(n)
        parts, index = (dp.size, dp.index) if self.stage else (1, 0)
        self.plans = [
            GroupPlan(
                g, self.stage, tuple(ns), tuple(tuple(self.params[n].shape) for n in ns), parts, index, zero.alignment
            )
            for g, ns in enumerate(groups)
        ]
        wd = list(group_weight_decay) if group_weight_decay is not None else [None] * len(self.plans)
        if len(wd) != len(self.plans):
            raise ValueError(f"group_weight_decay has {len(wd)} entries for {len(self.plans)} groups")
        self.weight_decay = [adam.weight_decay if w is None else float(w) for w in wd]
        self._where = {n: (g, i) for g, plan in enumerate(self.plans) for i, n in enumerate(plan.names)}
        self._name_by_id = {id(p): n for n, p in self.params.items()}
        self._check_against_view()
        self.adam_step = 0  # Adam updates applied (skipped fp16 steps do not count)
        self._micro = 0  # backward passes accumulated since the last step
        self.offload: OptimizerOffload | None = None
        self._staged: dict[str, list[torch.Tensor]] | None = None  # offloaded state staged for a checkpoint
        self.param_tier: ParamTier | None = None
        rank = dist.get_rank() if dist.is_initialized() else 0
        params_on_nvme = offload is not None and offload.offload_param.device == "nvme"
        if params_on_nvme and self.stage != 3:
            raise ValueError(f"offload_param.device 'nvme' needs ZeRO stage 3 (the stage is {self.stage})")
        if params_on_nvme and self.device.type != "cpu":
            raise ValueError(f"offload_param.device 'nvme' is not supported yet on {self.device} (a CPU engine only)")
        if offload is not None and offload.enabled:
            self.offload = OptimizerOffload(offload, [plan.size for plan in self.plans], rank=rank)
        try:
            self._build_buffers()
            if params_on_nvme:
                assert offload is not None
                self._params_to_tier(offload, rank)
        except BaseException:
            self.close()
            raise
        self._counted = self._norm_ranges()
        self._inflight: list[_Pending] = []
        self._early: _Early | None = None  # an offloaded update armed to run during backward (prepare_step)
        self._grad_stage: torch.Tensor | None = None  # a direct armed pass's sub-group gradient (_direct_gradient)
        self._reset_buckets()
        self.gatherer: ParamGatherer | None = None
        if self.stage == 3:
            spec = {}
            for g, plan in enumerate(self.plans):
                for i, n in enumerate(plan.names):
                    size = plan.param_part_size(i)
                    part = self.param_part[g][plan.offsets[i] : plan.offsets[i] + size]
                    spec[self.params[n]] = (plan.shapes[i], part, size * plan.parts)
            source = self.param_tier.source if self.param_tier is not None else None
            self.gatherer = ParamGatherer(module, spec, dp, prefetch=prefetch, source=source)
        for p in self.params.values():
            p.register_post_accumulate_grad_hook(self._grad_ready)

    @classmethod
    def for_module(
        cls,
        module: nn.Module,
        *,
        stage: int,
        adam: AdamConfig | None = None,
        dp: Comm | None = None,
        groups: Sequence[Sequence[str]] = (("*",),),
        group_weight_decay: Sequence[float | None] | None = None,
        alignment: int = 1,
        dtype: torch.dtype = torch.float32,
        clip: float | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        broadcast: bool = True,
        prefetch: bool = True,
        offload: OffloadConfig | None = None,
    ) -> "ZeroOptimizer":
        """ZeRO over plain data parallelism for any module (every parameter replicated over ``dp``, default: the world).

        ``groups``: name patterns per parameter group (first match wins, as in reshard.Zero);
        ``broadcast``: start every rank from dp rank 0's weights.
        """
        from reshard import RankCoord, Resolver
        from training.layout import module_layout

        dp = dp or Comm.world()
        if broadcast and dp.active:
            with torch.no_grad():
                for p in module.parameters():
                    dp.broadcast(p.data, 0)
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        layout = module_layout(dp.size, zero_stage=stage, zero_alignment=alignment, groups=groups)
        view = Resolver(layout, shapes).view(RankCoord(0, 0, dp.index))
        return cls(
            module,
            layout,
            view,
            dp=dp,
            world=dp,
            adam=adam or AdamConfig(),
            dtype=dtype,
            clip=clip,
            group_weight_decay=group_weight_decay,
            loss_scaler=loss_scaler,
            prefetch=prefetch,
            offload=offload,
        )

    # -- setup ---------------------------------------------------------------------------------
    def _check_against_view(self) -> None:
        """The partitions computed here must be the layout's, element for element."""
        if self.stage == 0:
            return
        for plan, buf in zip(self.plans, self.view.zero_groups):
            if buf.shape != (plan.size,):
                raise AssertionError(
                    f"ZeRO group {plan.index}: partition of {plan.size} elements here, {buf.shape[0]} in the layout"
                )

    @torch.no_grad()
    def _build_buffers(self) -> None:
        """Flat compute-dtype weights, fp32 masters and states, gradient accumulators; params become views."""
        self.flat_param: list[torch.Tensor] = []  # stages 0-2: D·P compute-dtype buffer per group
        self.param_part: list[torch.Tensor] = []  # stage 3: this rank's partitions, compute dtype
        self.master: list[torch.Tensor] = []
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        self.grad_acc: list[torch.Tensor] = []  # stages 0/1: D·P; stages 2/3: the partition
        for plan in self.plans:
            dev = next((self.params[n].device for n in plan.names), torch.device("cpu"))
            if self.stage == 3 and self.offload is not None:
                # The masters go straight to the tier, a sub-group at a time: never a whole fp32 copy here.
                part = torch.zeros(plan.size, dtype=self.dtype, device=dev)
                for s in plan.slices:
                    src = self.params[plan.names[s.param]].detach().reshape(-1)[s.start : s.stop]
                    part[s.offset : s.offset + s.numel].copy_(src)
                self.param_part.append(part)
                self.flat_param.append(torch.empty(0, dtype=self.dtype))
                self.offload.init_group_from(len(self.master), self._master_source(plan))
                master = torch.empty(0, dtype=torch.float32, device=dev)
                self.master.append(master)
                self.exp_avg.append(torch.zeros_like(master))
                self.exp_avg_sq.append(torch.zeros_like(master))
                self.grad_acc.append(torch.zeros(plan.size, dtype=torch.float32, device=dev))
                continue
            master = torch.zeros(plan.size, dtype=torch.float32, device=dev)
            if self.stage == 3:
                part = torch.zeros(plan.size, dtype=self.dtype, device=dev)
                for s in plan.slices:
                    src = self.params[plan.names[s.param]].detach().reshape(-1)[s.start : s.stop]
                    master[s.offset : s.offset + s.numel].copy_(src)
                part.copy_(master)
                self.param_part.append(part)
                self.flat_param.append(torch.empty(0, dtype=self.dtype))
            else:
                flat32 = torch.zeros(plan.padded_total, dtype=torch.float32, device=dev)
                for i, n in enumerate(plan.names):
                    flat32[plan.offsets[i] : plan.offsets[i] + plan.numels[i]].copy_(
                        self.params[n].detach().reshape(-1)
                    )
                lo = plan.rank * plan.size if self.stage else 0
                master.copy_(flat32[lo : lo + plan.size])
                flat = flat32.to(self.dtype) if self.dtype != torch.float32 else flat32
                for i, n in enumerate(plan.names):
                    self.params[n].data = flat[plan.offsets[i] : plan.offsets[i] + plan.numels[i]].view(plan.shapes[i])
                self.flat_param.append(flat)
                self.param_part.append(torch.empty(0, dtype=self.dtype))
            if self.offload is not None:  # the state goes to its tier now; only the gradients stay here
                self.offload.init_group(len(self.master), master)
                master = torch.empty(0, dtype=torch.float32, device=dev)
            self.master.append(master)
            self.exp_avg.append(torch.zeros_like(master))
            self.exp_avg_sq.append(torch.zeros_like(master))
            acc = plan.size if self.stage >= 2 else plan.padded_total
            self.grad_acc.append(torch.zeros(acc, dtype=torch.float32, device=dev))

    def _master_source(self, plan: GroupPlan) -> Callable[[int, int, torch.Tensor], None]:
        """Stage 3: fills ``out`` with elements ``[lo, hi)`` of ``plan``'s fp32 master partition, from the
        parameters (zeros where the partition is padding)."""

        def source(lo: int, hi: int, out: torch.Tensor) -> None:
            out.zero_()
            for s in plan.slices:
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < b:
                    src = self.params[plan.names[s.param]].detach().reshape(-1)
                    out[a - lo : b - lo].copy_(src[s.start + a - s.offset : s.start + b - s.offset])

        return source

    @torch.no_grad()
    def _params_to_tier(self, offload: OffloadConfig, rank: int) -> None:
        """Stage 3, ``offload_param`` nvme: the compute-dtype partitions go to their swap files; none stay here."""
        self.param_tier = tier = ParamTier(offload, self.plans, self.params, self.dtype, rank=rank, device=self.device)
        for g, part in enumerate(self.param_part):
            tier.write_group(g, part)
        tier.flush()
        self.param_part = [torch.empty(0, dtype=self.dtype, device=self.device) for _ in self.plans]

    def _norm_ranges(self) -> list[list[tuple[int, int]]]:
        """Per group, the ranges of this rank's gradient partition that count towards the global norm.

        A parameter's elements count on the rank whose copy is replica 0 over pipeline stages and tp
        (stage 0: over dp too, since every dp rank holds all of it); ZeRO partitions are disjoint over dp.
        """
        counted: dict[str, bool] = {}
        for n, buf in self.view.tensors.items():
            counted[n] = bool(buf.slots) and all(s.replica == 0 for s in buf.slots)
        if self.stage >= 1:
            for buf in self.view.zero_groups:
                for s in buf.slots:
                    counted[s.tensor] = s.replica == 0
        out: list[list[tuple[int, int]]] = []
        for plan in self.plans:
            out.append([(s.offset, s.offset + s.numel) for s in plan.slices if counted[plan.names[s.param]]])
        return out

    def _reset_buckets(self) -> None:
        self._pending: list[list[int]] = []
        self._buckets: list[list[torch.Tensor | None]] = []
        if self.stage != 2:
            return
        for plan in self.plans:
            pending = [0] * plan.parts
            for i in range(len(plan.names)):
                for k, _, _, _ in plan.owner_slices(i):
                    pending[k] += 1
            self._pending.append(pending)
            self._buckets.append([None] * plan.parts)

    # -- gradients -----------------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move the gradient into ZeRO's fp32 buffers and drop ``p.grad``."""
        grad = p.grad
        if grad is None:
            return
        p.grad = None
        g, i = self._where[self._name_by_id[id(p)]]
        plan = self.plans[g]
        flat = grad.detach().reshape(-1)
        with torch.no_grad():
            if self.stage <= 1:
                off = plan.offsets[i]
                self.grad_acc[g][off : off + plan.numels[i]].add_(flat)
            elif self.stage == 2:
                for k, a, b, dst in plan.owner_slices(i):
                    bucket = self._buckets[g][k]
                    if bucket is None:
                        bucket = self._buckets[g][k] = torch.zeros(plan.size, dtype=torch.float32, device=flat.device)
                    bucket[dst : dst + b - a].copy_(flat[a:b])
                    self._pending[g][k] -= 1
                    if self._pending[g][k] == 0:
                        self._launch_bucket(g, k)
            else:
                psize = plan.param_part_size(i)
                # The gradient cast into the head, zeros only in the padded tail: one write pass, not two
                # (torch.zeros then copy_ wrote the head twice; tools/bench_cast_wiring.py).
                inp = torch.empty(psize * plan.parts, dtype=torch.float32, device=flat.device)
                inp[: flat.numel()].copy_(flat)
                inp[flat.numel() :].zero_()
                work: Any
                if self.dp.active:
                    out = torch.empty(psize, dtype=torch.float32, device=flat.device)
                    work = self.dp.reduce_scatter(out, inp, async_op=True)
                else:  # one rank: the reduce-scatter would only copy it (a fresh 4 bytes/parameter a step)
                    out, work = inp, _Done()
                self._inflight.append(_Pending(g, i, out, work, keep=inp))
                assert self.gatherer is not None
                self.gatherer.release(p)  # type: ignore[arg-type]
                if self._early is not None:
                    self._absorb_finished()

    def _launch_bucket(self, g: int, k: int) -> None:
        buf = self._buckets[g][k]
        assert buf is not None
        self._buckets[g][k] = None
        work = self.dp.reduce(buf, k, async_op=True)
        self._inflight.append(_Pending(g, k, buf, work))

    def finish_backward(self) -> None:
        """After each backward pass (micro-batch): complete this pass's gradient reductions."""
        if self.stage == 2:
            for g, plan in enumerate(self.plans):  # parts some parameter got no gradient for: deterministic order
                for k in range(plan.parts):
                    if self._pending[g][k] > 0 and self._buckets[g][k] is not None:
                        self._launch_bucket(g, k)
        for job in self._inflight:
            job.work.wait()
            if self.stage == 2:
                if job.key == self.plans[job.group].rank:  # the bucket this rank owns
                    self.grad_acc[job.group].add_(job.out)
            else:
                self._absorb(job)
        self._inflight.clear()
        if self.stage == 2:
            self._reset_buckets()
        if self.gatherer is not None:
            self.gatherer.release_all()
        self._micro += 1
        if self._early is not None:  # every gradient is final now (also of members that got none in this pass)
            for g, plan in enumerate(self.plans):
                for i in range(len(plan.names)):
                    self._member_final(g, i)

    def _absorb(self, job: _Pending) -> None:
        """Stage 3: add a finished reduction (member ``job.key`` of group ``job.group``) to the gradient buffer
        (an armed direct pass keeps it as the member's gradient instead, :class:`_Early`)."""
        early = self._early
        if early is not None and early.direct:
            early.outs[(job.group, job.key)] = job.out
            self._member_final(job.group, job.key)
            return
        off = self.plans[job.group].offsets[job.key]
        self.grad_acc[job.group][off : off + job.out.numel()].add_(job.out)
        if self._early is not None:
            self._member_final(job.group, job.key)

    def _member_final(self, g: int, i: int) -> None:
        """Armed: member ``i`` of group ``g`` has its final gradient. Scale it as :meth:`step` would, take its
        terms of the global norm (the same values :meth:`_global_norm` would compute), and hand over the
        sub-groups this completes."""
        early = self._early
        assert early is not None
        if (g, i) in early.final:
            return
        early.final.add((g, i))
        plan = self.plans[g]
        off = plan.offsets[i]
        if early.direct:  # the member's own gradient (none: it got none in this pass, zeros)
            mine = early.outs.get((g, i))
            if mine is not None:
                mine.mul_(early.scale)
            for k in early.ranges.get((g, i), ()):
                a, b = self._counted[g][k]
                early.norm_terms[(g, k)] = (
                    _sum_of_squares(mine[a - off : b - off])
                    if mine is not None
                    else torch.zeros((), dtype=torch.float64, device=self.device)
                )
        else:
            grad = self._grad_partition(g)
            grad[off : off + plan.param_part_size(i)].mul_(early.scale)
            for k in early.ranges.get((g, i), ()):
                a, b = self._counted[g][k]
                early.norm_terms[(g, k)] = _sum_of_squares(grad[a:b])
        done = []
        for sg in early.members[(g, i)]:
            early.waiting[sg] -= 1
            if early.waiting[sg] == 0:
                done.append(sg)
        self._hand_over(done)

    def _absorb_finished(self) -> None:
        """Armed: fold the reductions that have completed into the gradient buffer now (never waits)."""
        left = []
        for job in self._inflight:
            if _finished(job.work):
                job.work.wait()
                self._absorb(job)
            else:
                left.append(job)
        self._inflight = left

    def _hand_over(self, indices: list[int]) -> None:
        """Sub-groups whose gradients are final (and scaled): given to the tier to update."""
        early = self._early
        if not indices or early is None:
            return
        assert self.offload is not None
        for i in indices:
            early.waiting[i] = 0
        self.offload.ready(indices)

    def _release_gradient(self, sg: SubGroup) -> None:
        """The tier has updated ``sg``: its gradient is spent. Zero it and give its pages back to the system
        (they fault back in, zeroed, when the next backward adds to them), so that the gradient partition is
        resident only for the sub-groups backward has begun and the tier not yet updated."""
        release_zeroed(self._grad_partition(sg.group)[sg.lo : sg.hi])

    def _direct_gradient(self, early: _Early, owners: list[list[int]]) -> Callable[[SubGroup], torch.Tensor]:
        """A direct pass's gradient of a sub-group (``owners[j]``: the members sub-group ``j`` overlaps): its
        members' gradients gathered into :attr:`_grad_stage`, valid until the next call (the tier updates one
        sub-group at a time)."""
        largest = max((sg.numel for sg in self.offload.subgroups), default=0) if self.offload is not None else 0
        if self._grad_stage is None or self._grad_stage.numel() < largest:
            self._grad_stage = torch.empty(largest, dtype=torch.float32, device=self.device)
        stage = self._grad_stage

        def gradient(sg: SubGroup) -> torch.Tensor:
            plan = self.plans[sg.group]
            buf = stage[: sg.numel]
            for i in owners[sg.index]:  # stage 3's members tile the partition: every element is someone's
                lo = plan.offsets[i]
                a, b = max(lo, sg.lo), min(lo + plan.param_part_size(i), sg.hi)
                mine = early.outs.get((sg.group, i))
                if mine is None:
                    buf[a - sg.lo : b - sg.lo].zero_()
                else:
                    buf[a - sg.lo : b - sg.lo].copy_(mine[a - lo : b - lo])
            return buf

        return gradient

    def _spent_direct(self, early: _Early, owners: list[list[int]]) -> Callable[[SubGroup], None]:
        """A direct pass's ``updated`` callback: a member's gradient is dropped once all its sub-groups are."""

        def spent(sg: SubGroup) -> None:
            for i in owners[sg.index]:
                key = (sg.group, i)
                early.left[key] -= 1
                if early.left[key] == 0:
                    early.outs.pop(key, None)

        return spent

    # -- the offloaded update during backward (stage 3) ---------------------------------------------
    def can_update_early(self) -> bool:
        """Whether the offloaded update may run during the step's last backward pass (:meth:`prepare_step`):
        ZeRO-3 with an optimizer tier that can, no gradient clipping and no loss scaling (each sub-group's
        update then needs only its own gradients, so it can start as soon as backward has made them)."""
        return (
            self.offload is not None
            and self.offload.can_update_early
            and self.stage == 3
            and self.param_tier is None
            and self.scaler is None
            and not (self.clip is not None and self.clip > 0)
            and not self.tied
        )

    @torch.no_grad()
    def prepare_step(self, lr: float | None = None) -> bool:
        """Before the backward pass that ends the step's accumulation, with the ``lr`` :meth:`step` will get:
        arm the offload tier so that each sub-group is updated (read, Adam, written back, its weights cast)
        as soon as backward has finished its gradients, instead of all of them in :meth:`step`. The losses
        and weights are bit-identical either way. False (and nothing armed) where :meth:`can_update_early`
        is not; the weights change during that backward, so a checkpoint copy must be done before it."""
        if not self.can_update_early():
            return False
        assert self.offload is not None
        if self._early is not None:
            raise RuntimeError("prepare_step twice without a step")
        self._staged = None
        scale = 1.0 / (self.dp.size * (self._micro + 1) * 1.0)  # step()'s scale, this pass included
        casts = [self._cast_target(g) for g in range(len(self.plans))]
        grads = [self._grad_partition(g) for g in range(len(self.plans))]
        ranges: dict[tuple[int, int], list[int]] = {}  # (group, member) -> its ranges of the global norm
        for g, plan in enumerate(self.plans):
            start = {s.offset: s.param for s in plan.slices}
            for k, (a, _) in enumerate(self._counted[g]):
                ranges.setdefault((g, start[a]), []).append(k)
        members: dict[tuple[int, int], list[int]] = {}
        waiting = [0] * len(self.offload.subgroups)
        for g, plan in enumerate(self.plans):
            ofg = self.offload.of_group(g)
            for i in range(len(plan.names)):
                lo, hi = plan.offsets[i], plan.offsets[i] + plan.param_part_size(i)
                members[(g, i)] = [sub.index for sub in ofg if sub.lo < hi and lo < sub.hi]
                for j in members[(g, i)]:
                    waiting[j] += 1
        # Backward finishes the parameters in about the reverse of their order: a sub-group is complete once its
        # first member is. The tier reads in this order until it has seen the real one (offload.order).
        position = {(g, i): n for n, (g, i) in enumerate(self._where[name] for name in self.params)}
        first = [len(position)] * len(waiting)
        for key, idx in members.items():
            for j in idx:
                first[j] = min(first[j], position[key])
        self.offload.suggest_order(sorted(range(len(waiting)), key=lambda j: -first[j]))
        early = _Early(scale, casts, members, waiting, ranges, direct=self._micro == 0)
        gradient: Callable[[SubGroup], torch.Tensor] | None = None
        updated: Callable[[SubGroup], None] = self._release_gradient
        if early.direct:
            owners: list[list[int]] = [[] for _ in waiting]
            for (g, i), idx in members.items():
                early.left[(g, i)] = len(idx)
                for j in idx:
                    owners[j].append(i)
            for acc in self.grad_acc:  # zeros, and stays so this step: its pages go back (once; then no-ops)
                release_zeroed(acc)
            gradient, updated = self._direct_gradient(early, owners), self._spent_direct(early, owners)
        self.offload.begin_step(
            grads,
            casts,
            adam=self.adam,
            step=self.adam_step + 1,
            lr=lr,
            weight_decay=self.weight_decay,
            grad_scale=1.0,
            updated=updated,
            gradient=gradient,
        )
        self._early = early
        return True

    def backward(self, loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """``loss.backward()`` (times the fp16 loss scale), then :meth:`finish_backward`.

        With ``grad`` given, ``loss`` is an intermediate output (pipeline stage) and ``grad`` its gradient.
        """
        if self.gatherer is not None:
            self.gatherer.begin_backward()
        if grad is None:
            if self.scaler is not None:
                loss = loss * self.scaler.scale
            loss.backward()
        else:
            torch.autograd.backward(loss, grad)
        self.finish_backward()

    def forward_context(self) -> Any:
        """Wrap each forward pass: stage 3 swaps saved parameter views for references (see stage3)."""
        if self.gatherer is None:
            return _Null()
        self.gatherer.begin_forward()
        return self.gatherer.saved_tensors()

    # -- the step ------------------------------------------------------------------------------
    def _grad_partition(self, g: int) -> torch.Tensor:
        plan = self.plans[g]
        if self.stage == 1:
            return self.grad_acc[g][plan.rank * plan.size : (plan.rank + 1) * plan.size]
        return self.grad_acc[g]

    @torch.no_grad()
    def step(self, lr: float | None = None) -> dict[str, float | bool]:
        """Reduce, unscale, clip and apply the accumulated gradients; returns ``{grad_norm, skipped}``."""
        if self._micro == 0:
            raise RuntimeError("step() without a backward pass since the last step")
        self._staged = None  # staged for a checkpoint before this step: stale from now on
        if self.param_tier is not None:
            self.param_tier.drop_staged()
        if self.stage <= 1:
            for name in self.tied:
                g, i = self._where[name]
                off = self.plans[g].offsets[i]
                self.tied_comm.all_reduce(self.grad_acc[g][off : off + self.plans[g].numels[i]])
            for acc in self.grad_acc:
                self.dp.all_reduce(acc)
        early, self._early = self._early, None
        scale = 1.0 / (self.dp.size * self._micro * (self.scaler.scale if self.scaler else 1.0))
        grads = [self._grad_partition(g) for g in range(len(self.plans))]
        if early is None:  # armed: every sub-group was scaled as backward handed it over
            for gr in grads:
                gr.mul_(scale)
        skipped = False
        if self.scaler is not None:
            bad = torch.zeros(1, device=self.device)
            for gr in grads:
                if gr.numel() and not bool(torch.isfinite(gr).all()):
                    bad.fill_(1)
            self.world.all_reduce(bad, op=dist.ReduceOp.MAX)
            skipped = bool(bad.item())
            self.scaler.update(skipped)
        if skipped:
            norm = float("nan")
        elif early is not None:  # the terms were taken as backward made each gradient final
            norm = self._norm_of_terms(early)
        else:
            norm = self._global_norm(grads)
        if not skipped:  # an overflowed fp16 step never reaches the kernel
            coef = 1.0
            if self.clip is not None and self.clip > 0:
                coef = min(self.clip / (norm + 1e-6), 1.0)  # folded into the update's read of the gradient
            self.adam_step += 1
            casts = early.casts if early is not None else [self._cast_target(g) for g in range(len(self.plans))]
            if self.offload is not None:
                self.offload.step(
                    grads,
                    casts,
                    adam=self.adam,
                    step=self.adam_step,
                    lr=lr,
                    weight_decay=self.weight_decay,
                    grad_scale=coef,
                )
            for g, gr in enumerate(grads):
                if self.offload is None and self.master[g].numel():
                    adam_update(
                        self.master[g],
                        gr,
                        self.exp_avg[g],
                        self.exp_avg_sq[g],
                        self.adam_step,
                        self.adam,
                        lr=lr,
                        weight_decay=self.weight_decay[g],
                        grad_scale=coef,
                        out=casts[g],
                    )
            self.publish(casts)
        if early is None:  # armed: the tier zeroed (and released) each sub-group's gradient as it updated it
            for acc in self.grad_acc:
                acc.zero_()
        self._micro = 0
        return {"grad_norm": norm, "skipped": skipped}

    def _norm_of_terms(self, early: _Early) -> float:
        """:meth:`_global_norm` from the terms an armed pass took as each gradient became final."""
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for g, ranges in enumerate(self._counted):
            for k in range(len(ranges)):
                total += early.norm_terms[(g, k)]
        self.world.all_reduce(total)
        return math.sqrt(float(total.item()))

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for gr, ranges in zip(grads, self._counted):
            for a, b in ranges:
                total += gr[a:b].double().pow(2).sum()
        self.world.all_reduce(total)
        return math.sqrt(float(total.item()))

    def cast_targets(self) -> list[torch.Tensor | None]:
        """For an update that writes the compute-dtype weights itself (an offloaded step, or a load that
        streams the masters into the tier): :meth:`_cast_target` of every group, for :meth:`publish`."""
        return [self._cast_target(g) for g in range(len(self.plans))]

    def _cast_target(self, g: int) -> torch.Tensor | None:
        """Where the update writes group ``g``'s compute-dtype weights in its own pass (the copy-back):
        the weights themselves (stages 0/3) or this rank's slot, to be all-gathered (stages 1/2)."""
        size = self.plans[g].size
        if not size:
            return None
        target = self.param_part[g] if self.stage == 3 else self.flat_param[g] if self.stage == 0 else None
        if target is None:
            return torch.empty(size, dtype=self.dtype, device=self.device)
        if target.is_contiguous() and target.numel() == size:
            return target
        elsewhere = self.offload is not None or self.param_tier is not None  # the update's casts go to a tier
        return torch.empty(size, dtype=self.dtype, device=self.device) if elsewhere else None

    @torch.no_grad()
    def publish(self, casts: Sequence[torch.Tensor | None] | None = None, *, weights_written: bool = False) -> None:
        """Compute-dtype weights from the fp32 masters: cast, and all-gather over dp (stages 1/2).

        ``casts[g]`` is :meth:`_cast_target`'s tensor already holding the cast (the fused update wrote
        it); ``None`` entries (or no ``casts``) are cast here. ``weights_written``: the parameter tier
        (``offload_param`` nvme) already holds them (a load streamed the masters' casts into it).
        """
        if weights_written:
            if self.param_tier is None:
                raise RuntimeError("weights_written=True needs the parameter tier (offload_param nvme)")
            self.param_tier.drop_staged()
            return
        masters = self.master
        if self.offload is not None and casts is None:  # after a load: the staged state goes to the tier
            masters = self._push_staged()
        if self.param_tier is not None:
            self.param_tier.drop_staged()  # the weights are derived from the masters again
        for g, plan in enumerate(self.plans):
            done = casts[g] if casts is not None else None
            if self.param_tier is not None:  # stage 3, partitions on NVMe
                if plan.size:
                    self.param_tier.write_group(g, done if done is not None else masters[g])
            elif self.stage == 3:
                if done is None:
                    self.param_part[g].copy_(masters[g])
                elif done is not self.param_part[g]:
                    self.param_part[g].copy_(done)
            elif self.stage == 0:
                if done is None:
                    self.flat_param[g].copy_(masters[g])
                elif done is not self.flat_param[g]:
                    self.flat_param[g].copy_(done)
            elif plan.size:
                mine = done if done is not None else masters[g].to(self.dtype)
                self.dp.all_gather(self.flat_param[g], mine)
        if self.param_tier is not None:
            self.param_tier.flush()

    @torch.no_grad()
    def masters_from_weights(self) -> None:
        """fp32 masters from the compute-dtype weights (after loading weights only)."""
        masters = self._stage()["fp32_master"] if self.offload is not None else self.master
        parts = self.param_tier.stage() if self.param_tier is not None else self.param_part
        for g, plan in enumerate(self.plans):
            if self.stage == 3:
                masters[g].copy_(parts[g])
            else:
                lo = plan.rank * plan.size if self.stage else 0
                masters[g].copy_(self.flat_param[g][lo : lo + plan.size])
        if self.offload is not None:
            self._push_staged()
        if self.param_tier is not None:
            self.param_tier.push_staged()  # the loaded weights, as loaded

    def zero_grad(self) -> None:
        """Forget accumulated gradients (e.g. after an aborted step)."""
        for acc in self.grad_acc:
            acc.zero_()
        self._micro = 0

    def reset(self) -> None:
        """Forget everything of a step in progress, so the next step starts clean: accumulated and
        in-flight gradients, stage-2 buckets, stage-3 gathered parameters.

        For a train_step that raised, and before a load. Collectives in flight are dropped, not waited
        for: if the failure hit this rank only, its peers never join them and a wait would hang
        (such a run needs a restart anyway; a failure every rank saw leaves nothing unmatched).
        """
        self._inflight.clear()
        if self._early is not None:  # an update armed for this step: abandoned (the tier says if it began)
            self._early = None
            assert self.offload is not None
            self.offload.abort()
        self._reset_buckets()
        for p in self.params.values():
            p.grad = None
        self.zero_grad()
        if self.gatherer is not None:
            self.gatherer.reset()

    # -- the checkpoint seam -------------------------------------------------------------------
    def buffers(
        self,
        states: Mapping[str, Sequence[torch.Tensor]] | None = None,
        params: Sequence[torch.Tensor] | None = None,
    ) -> list[tuple[str, LocalBuffer, torch.Tensor]]:
        """``(section, layout buffer, tensor holding it)`` for every buffer of this rank.

        Sections: ``"model"`` (compute-dtype weights; stage 3: the partitions) and each of
        :data:`STATE_KEYS`. Slots of each buffer name the *parameter* (global name); the tensor is a
        view of the live storage, so filling it in place loads the engine.

        With offload, the optimizer states are *staged*: read from the tier into tensors of their own
        (this rank's whole optimizer state in memory, for the save or load), which :meth:`publish`
        (after a load) writes back to the tier and :meth:`drop_staged` (after a save) lets go.
        ``states`` (key -> one whole-partition tensor per group) replaces the optimizer states instead:
        meta tensors give the layout of offloaded state without reading it (training.offload.checkpoint).
        ``params`` (one whole-partition tensor per group) likewise replaces stage 3's compute-dtype partitions,
        which are otherwise staged from their tier with ``offload_param`` nvme.
        """
        out: list[tuple[str, LocalBuffer, torch.Tensor]] = []
        if params is not None:
            parts = list(params)
        else:
            parts = self.param_tier.stage() if self.param_tier is not None else self.param_part  # staged from NVMe
        for buf in self.view.weights():
            n = buf.name
            g, i = self._where[n]
            plan = self.plans[g]
            if self.stage == 3:
                off = plan.offsets[i]
                out.append(("model", buf, parts[g][off : off + plan.param_part_size(i)]))
            else:
                off = plan.offsets[i]
                out.append(("model", buf, self.flat_param[g][off : off + plan.numels[i]].view(plan.shapes[i])))
        if states is None:
            states = (
                self._stage()
                if self.offload is not None
                else {"fp32_master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
            )
        for key, tensors in states.items():
            bufs = self.view.optimizer_state(key, lambda p, k: p)
            if self.stage == 0:
                for buf in bufs:
                    g, i = self._where[buf.name]
                    plan = self.plans[g]
                    off = plan.offsets[i]
                    out.append((key, buf, tensors[g][off : off + plan.numels[i]].view(plan.shapes[i])))
            else:
                for g, buf in enumerate(bufs):
                    out.append((key, buf, tensors[g]))
        return out

    def scalars(self) -> dict[str, Any]:
        return {
            "adam_step": self.adam_step,
            "loss_scale": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_scalars(self, state: dict[str, Any]) -> None:
        self.adam_step = int(state["adam_step"])
        if self.scaler is not None and state.get("loss_scale") is not None:
            self.scaler.load_state_dict(state["loss_scale"])

    def _stage(self) -> dict[str, list[torch.Tensor]]:
        """The offloaded state as whole-partition tensors (read from the tier once; kept until pushed or dropped)."""
        assert self.offload is not None
        if self._staged is None:
            staged: dict[str, list[torch.Tensor]] = {k: [] for k in STATE_KEYS}
            for g in range(len(self.plans)):
                for key, t in zip(STATE_KEYS, self.offload.gather_group(g, self.device)):
                    staged[key].append(t)
            self._staged = staged
        return self._staged

    def _push_staged(self) -> list[torch.Tensor]:
        """Write the staged state (as a load left it) into the tier; returns the staged masters."""
        assert self.offload is not None
        staged = self._stage()
        for g in range(len(self.plans)):
            self.offload.init_group(g, *(staged[key][g] for key in STATE_KEYS))
        self._staged = None
        return staged["fp32_master"]

    def prepare_load(self) -> None:
        """Before a load fills the state (:meth:`buffers`): with an offload tier that an earlier failed step
        left partly updated, stage zeros instead of reading it; the load overwrites them."""
        if self.offload is not None and self.offload.broken is not None:
            self._staged = {
                key: [torch.zeros(plan.size, dtype=torch.float32, device=self.device) for plan in self.plans]
                for key in STATE_KEYS
            }

    def drop_staged(self) -> None:
        """Let go of the offloaded state staged for a checkpoint (:meth:`buffers`); the tier keeps the state."""
        self._staged = None
        if self.param_tier is not None:
            self.param_tier.drop_staged()

    def close(self) -> None:
        """Release the offload tiers (their swap directories are removed); idempotent. Without offload: nothing."""
        if self.offload is not None:
            self.offload.close()
        if getattr(self, "param_tier", None) is not None:
            assert self.param_tier is not None
            self.param_tier.close()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _preview(names: Iterable[str]) -> str:
    names = list(names)
    return "[" + ", ".join(names[:4]) + (f", ... ({len(names)} in all)]" if len(names) > 4 else "]")
