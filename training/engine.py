"""The training engine: the reference GPT under TP × PP × DP with ZeRO, one call per optimizer step.

::

    engine = Engine("tiny", mesh={"tp": 2, "pp": 1, "dp": 2}, zero_stage=2, dtype="bf16", lr=1e-3)
    for step in range(100):
        loss = engine.train_step(step)          # same value on every rank

Data: ``training.models.gpt.batch_for_step`` — the global batch of a step has
``micro_batch · dp · grad_accum`` rows; dp rank d's micro-step m takes its contiguous block, so any
mesh (and a resumed run) sees the same stream. Weights start as ``GPT(cfg, seed)``'s, sliced
through the layout, so every mesh starts from the single-process model.

Checkpointing (the seam for ucp): :meth:`Engine.checkpoint_targets` / :meth:`Engine.state_dict_for_checkpoint`
give this rank's weights and optimizer states as ucp pieces of the global tensors, viewing live
storage; after filling them (``ucp.load(path, into=sd)``), :meth:`Engine.finish_load` restores the
scalars and re-derives the compute weights. :meth:`Engine.save` / :meth:`Engine.load` do this through a
``ucp.CheckpointManager`` (or a checkpoint directory), from any mesh and ZeRO stage to any other.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator

import ucp
from reshard import Mesh, Resolver
from reshard.pipeline import stage_layers
from ucp.conversion.placement import layout_metadata
from ucp.format.tree import path_str

from .adam import AdamConfig
from .checkpoint import CheckpointTargets, build_targets, fill_from_full
from .compat import check_resumable
from .layout import gpt_layout, gpt_shapes
from .mesh import ParallelMesh, build_mesh
from .models.gpt import PRESETS, GPTConfig, batch_for_step
from .offload import OffloadConfig
from .offload.checkpoint import STATE_KEYS, Span, TierReader, load_tier, streamed_params, streamed_sections
from .offload.checkpoint import layout as offloaded_layout
from .offload.params import ParamCopy
from .parallel.gpt import build_stage
from .parallel.pipeline import SCHEDULES
from .saving import InFlightSaves
from .zero import DynamicLossScaler, LossScaleConfig, ZeroOptimizer

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class EngineConfig(BaseModel):
    """Everything a run depends on (with the mesh): model, parallelism, precision, optimizer, data."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: GPTConfig
    mesh: Mesh = Mesh()
    zero_stage: Literal[0, 1, 2, 3] = 1
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    micro_batch: int = Field(2, ge=1, description="rows per micro-batch per dp rank")
    grad_accum: int = Field(1, ge=1, description="micro-batches per step (per dp rank); the pipeline's micro-batches")
    seq_len: int | None = Field(None, ge=1, description="tokens per row; default model.max_seq")
    lr: float = Field(1e-3, ge=0)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = Field(0.0, ge=0, description="for weights; biases and layernorms get none")
    optimizer: Literal["adamw", "adam"] = "adamw"
    adam_torch_sqrt: bool = Field(
        True,
        description="kernels.adam's bit-equal mode (torch.optim's sqrt; False: IEEE sqrt, faster, within a few ulp)",
    )
    clip: float | None = Field(None, gt=0, description="clip gradients to this global L2 norm")
    seed: int = 0
    data_seed: int = 0
    zero_alignment: int = Field(1, ge=1, description="ZeRO partition sizes are multiples of this (elements)")
    pad_vocab_to: int = Field(128, ge=1, description="vocabulary padded to a multiple of this × tp")
    loss_scale: LossScaleConfig = LossScaleConfig()
    prefetch: bool = True
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    device: str = Field("cpu", description='"cpu", "cuda" (this process\'s current CUDA device) or "cuda:N"')
    offload: OffloadConfig = Field(
        OffloadConfig(),
        description="DeepSpeed's offload_optimizer / offload_param / sub_group_size / aio (OffloadConfig.from_deepspeed)",
    )

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        seq = self.seq_len or self.model.max_seq
        if seq > self.model.max_seq:
            raise ValueError(f"seq_len {seq} exceeds the model's max_seq {self.model.max_seq}")
        if self.mesh.pp > 1 and self.zero_stage > 1:
            raise ValueError("pipeline parallelism (pp > 1) supports ZeRO stages 0 and 1 only")
        if self.mesh.pp > self.model.n_layer:
            raise ValueError(f"pp={self.mesh.pp} exceeds the number of layers ({self.model.n_layer})")
        off = self.offload
        if off.zero_stage is not None and off.zero_stage != self.zero_stage:
            raise ValueError(
                f"zero_optimization.stage {off.zero_stage} of the offload config differs from zero_stage {self.zero_stage}"
            )
        param = off.offload_param.device
        if param != "none" and self.zero_stage != 3:
            raise ValueError(f"offload_param.device {param!r} needs ZeRO stage 3 (zero_stage is {self.zero_stage})")
        if param != "none" and self.device != "cpu":
            raise ValueError(
                f"offload_param.device {param!r} is not supported yet on {self.device} (a CPU engine only)"
            )
        return self

    @property
    def seq(self) -> int:
        return self.seq_len or self.model.max_seq

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.mesh.dp * self.grad_accum


class Engine:
    """One rank's part of a run. Call every method on every rank (they communicate)."""

    def __init__(
        self,
        model: GPTConfig | str | EngineConfig,
        mesh: dict[str, Any] | Mesh | None = None,
        lr_schedule: Callable[[int], float] | None = None,
        **options: Any,
    ) -> None:
        if isinstance(model, EngineConfig):
            if mesh is not None or options:
                raise TypeError("give either an EngineConfig or a model with options, not both")
            cfg = model
        else:
            gpt = PRESETS[model] if isinstance(model, str) else model
            mesh_obj = Mesh(**mesh) if isinstance(mesh, dict) else (mesh or Mesh())
            cfg = EngineConfig(model=gpt, mesh=mesh_obj, **options)
        self.cfg = cfg
        self.lr_schedule = lr_schedule
        self.mesh: ParallelMesh = build_mesh(cfg.mesh)
        self.shapes = gpt_shapes(cfg.model)
        self.layout = gpt_layout(
            cfg.model,
            cfg.mesh,
            zero_stage=cfg.zero_stage,
            zero_alignment=cfg.zero_alignment,
            pad_vocab_to=cfg.pad_vocab_to,
        )
        self.view = Resolver(self.layout, self.shapes).view(self.mesh.coord)
        stage = self.mesh.coord.pp
        layers = stage_layers(self.layout.pipeline, set(range(cfg.model.n_layer)), cfg.mesh.pp)[stage]
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model = build_stage(
            cfg.model, self.view, self.mesh.tp_comm, layers, self.mesh.first_stage, self.mesh.last_stage, cfg.seed
        ).to(self.device)
        self.dtype = DTYPES[cfg.dtype]
        adam = AdamConfig(
            lr=cfg.lr,
            beta1=cfg.beta1,
            beta2=cfg.beta2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            decoupled=cfg.optimizer == "adamw",
            torch_sqrt=cfg.adam_torch_sqrt,
        )
        tied = ["embed.weight"] if cfg.model.tied_embeddings and cfg.mesh.pp > 1 else []
        self.optimizer = ZeroOptimizer(
            self.model,
            self.layout,
            self.view,
            dp=self.mesh.dp_comm,
            world=self.mesh.world,
            adam=adam,
            dtype=self.dtype,
            clip=cfg.clip,
            group_weight_decay=[0.0, None],
            loss_scaler=DynamicLossScaler(cfg.loss_scale) if cfg.dtype == "fp16" else None,
            tied=tied,
            tied_comm=self.mesh.embed_comm,
            prefetch=cfg.prefetch,
            offload=cfg.offload,
        )
        self.step = 0  # optimizer steps completed (the next train_step's step number)
        self._saves = InFlightSaves(self.optimizer)  # how a checkpoint is saved, and the asynchronous ones running
        self.last_stats: dict[str, Any] = {}
        self._spans: dict[str, list[Span]] = {}  # offload on, during a load: the optimizer states' pieces
        self._loaded_casts: list[torch.Tensor | None] | None = None  # ... and the masters' casts it made
        self._weights_written = False  # ... or, offload_param nvme, that it wrote them to the parameter tier

    def close(self) -> None:
        """Release what outlives a step: the optimizer's offload tier (its swap directory is removed).
        Idempotent; also done at interpreter exit. Waits for asynchronous saves still streaming a copy of the
        tier's swap files (it lies in the swap directory)."""
        self._saves.close()  # a failure is the save's to report (result(), the manager's wait())
        self.optimizer.close()

    @property
    def last_checkpoint_io(self) -> dict[str, int]:
        """Offload on: what the last synchronous save read from the optimizer's tier (``bytes_read``,
        ``buffer_bytes``); empty after any other save."""
        return self._saves.last_io

    # -- training ------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        return self.lr_schedule(step) if self.lr_schedule is not None else self.cfg.lr

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        tokens, targets = batch_for_step(
            step,
            c.micro_batch,
            c.seq,
            c.model.vocab_size,
            c.data_seed,
            rank=self.mesh.coord.dp,
            world_size=c.mesh.dp,
            micro_step=micro,
            grad_accum=c.grad_accum,
        )
        return tokens.to(self.device), targets.to(self.device)

    def train_step(self, step: int | None = None) -> float:
        """Forward and backward over this step's micro-batches, then the optimizer step; returns the mean loss."""
        step = self.step if step is None else step
        self.model.train()
        losses: list[torch.Tensor] = []
        batches = [self.batch(step, m) for m in range(self.cfg.grad_accum)]
        try:
            if self.cfg.mesh.pp == 1:
                for m, (tokens, targets) in enumerate(batches):
                    with self.optimizer.forward_context():
                        loss = self.model(tokens, targets)
                    if m == len(batches) - 1 and self.optimizer.can_update_early():
                        # The offloaded update runs during this backward, as it makes each sub-group's
                        # gradients (ZeroOptimizer.prepare_step): the weights change from here on.
                        self.wait_snapshot()
                        self.optimizer.prepare_step(lr=self.lr_at(step))
                    self.optimizer.backward(loss)
                    losses.append(loss.detach())
            else:
                act = (self.cfg.micro_batch, self.cfg.seq, self.cfg.model.d_model)
                schedule = SCHEDULES[self.cfg.pipeline_schedule]
                schedule(self.model, self.optimizer, self.mesh, batches, act, self.dtype, losses.append, self.device)
            self.wait_snapshot()  # a background checkpoint copy must be done before the weights change
            self.last_stats = self.optimizer.step(lr=self.lr_at(step))
        except BaseException:
            # An aborted step (OOM, ^C, a failing hook) must not leave its gradients or gathered
            # weights to the next step; a failure inside the optimizer step itself may have left the
            # weights half updated, which only a load repairs.
            self.optimizer.reset()
            raise
        self.step = step + 1
        return self._report(losses)

    def _report(self, losses: list[torch.Tensor]) -> float:
        """The step's loss on every rank: mean over micro-batches and dp, sent from the last stage."""
        value = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.mesh.last_stage:
            value += torch.stack([x.double() for x in losses]).mean()
            self.mesh.dp_comm.all_reduce(value)
            value /= self.mesh.dp_comm.size
        self.mesh.pp_comm.broadcast(value, self.cfg.mesh.pp - 1)
        return float(value.item())

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Loss of one batch without training (pp = 1 only)."""
        if self.cfg.mesh.pp != 1:
            raise NotImplementedError("eval_loss runs pp = 1 models only")
        with self.optimizer.forward_context():
            loss = self.model(tokens, targets)
        if self.optimizer.gatherer is not None:
            self.optimizer.gatherer.release_all()
        return float(loss)

    # -- the checkpoint seam -------------------------------------------------------------------
    def checkpoint_targets(self) -> CheckpointTargets:
        """This rank's pieces of every global tensor: section ``model`` (weights, compute dtype) and
        ``fp32_master`` / ``exp_avg`` / ``exp_avg_sq``; views of live storage."""
        return build_targets(self.optimizer.buffers(), self.shapes)

    def state_dict_for_checkpoint(
        self, streamed: TierReader | None = None, *, stream_params: bool | ParamCopy = False
    ) -> dict[str, Any]:
        """The nested dict to save with ucp (and to fill with ``ucp.load(path, into=...)``).

        ``{"model": {name: piece}, "optimizer": {"fp32_master"|"exp_avg"|"exp_avg_sq": {name: piece},
        "adam_step", "loss_scale", "hparams"}, "step", "scheduler", "rng"}``; a name maps to a
        ``ucp.Shards`` where this rank holds several regions of the tensor (tp > 1), and is absent where it
        holds none (another pipeline stage, or a ZeRO partition that misses it).

        ``streamed`` (offload on, a synchronous save): the optimizer states' pieces are StreamedShards
        whose bytes it reads from the tier while the save writes them (training.offload.checkpoint).
        ``stream_params`` (``offload_param`` nvme, a synchronous save): so are the model's pieces, read from
        the parameters' swap files (:func:`training.offload.checkpoint.streamed_params`), or from that copy of
        them (an asynchronous save).
        """
        tier = self.optimizer.param_tier if stream_params else None
        if streamed is None and tier is None:
            nested = self.checkpoint_targets().nested()
        else:
            nested, found = offloaded_layout(
                self.optimizer, self.shapes, states=streamed is not None, params=tier is not None
            )
            if streamed is not None:
                nested |= streamed_sections({k: found[k] for k in STATE_KEYS}, streamed)
            if tier is not None:
                source = stream_params if isinstance(stream_params, ParamCopy) else None
                nested["model"] = streamed_params(found["model"], tier, source)
        c = self.cfg
        optim: dict[str, Any] = {k: nested.get(k, {}) for k in ("fp32_master", "exp_avg", "exp_avg_sq")}
        optim |= self.optimizer.scalars()
        optim["hparams"] = {
            "kind": c.optimizer,
            "lr": c.lr,
            "betas": [c.beta1, c.beta2],
            "eps": c.eps,
            "weight_decay": self.optimizer.weight_decay,
        }
        return {
            "model": nested.get("model", {}),
            "optimizer": optim,
            "step": self.step,
            "scheduler": {"kind": "constant" if self.lr_schedule is None else "callable", "last_step": self.step},
            "rng": {"seed": c.seed, "data_seed": c.data_seed},  # no dropout: the data stream is (data_seed, step)
        }

    def load_from_full(
        self,
        get: Callable[[str, str], torch.Tensor | None],
        *,
        step: int,
        adam_step: int | None = None,
        from_masters: bool = True,
    ) -> None:
        """Load from full global tensors in memory: ``get(section, name)`` (sections as in
        :meth:`checkpoint_targets`; None skips a tensor), then :meth:`finish_load`.

        For importers that produce whole tensors (a peer's checkpoint, a single-process state dict).
        """
        self.wait_snapshot()
        self.optimizer.prepare_load()
        fill_from_full(self.checkpoint_targets(), get)
        optim = {} if adam_step is None else {"adam_step": adam_step, "loss_scale": None}
        self.finish_load({"step": step, "optimizer": optim}, from_masters=from_masters)

    def finish_load(
        self,
        state: dict[str, Any],
        *,
        from_masters: bool = True,
        casts: list[torch.Tensor | None] | None = None,
        weights_written: bool = False,
    ) -> None:
        """After the pieces of ``state`` (from :meth:`state_dict_for_checkpoint`) were filled: restore the
        step counters and loss scale, and make the compute weights consistent.

        ``from_masters``: weights are re-derived from the loaded fp32 masters (cast, all-gathered);
        otherwise the masters are taken from the loaded weights (a weights-only checkpoint; Adam's
        moments are whatever was loaded, zeros for a fresh engine). ``casts``: the masters' casts, already
        made (a load that streamed the masters into the offload tier), for :meth:`ZeroOptimizer.publish`;
        ``weights_written``: the parameter tier holds them already (``offload_param`` nvme, streamed in).
        """
        self.optimizer.reset()  # whatever a step in progress left must not reach the loaded state
        self.step = int(state["step"])
        optim = state.get("optimizer", {})
        if "adam_step" in optim:
            self.optimizer.load_scalars(optim)
        if from_masters:
            self.optimizer.publish(casts, weights_written=weights_written)
        else:
            self.optimizer.masters_from_weights()

    # -- saving and resuming through ucp --------------------------------------------------------
    def save(self, manager: ucp.CheckpointManager, step: int | None = None) -> ucp.Manifest | ucp.SaveHandle:
        """Save this run as checkpoint ``step`` (default: :attr:`step`, the steps completed) of ``manager``.

        Call on every rank. With an asynchronous manager this returns once the live pieces were
        snapshotted (a SaveHandle), so training may go on while the checkpoint is written. The
        metadata records the mesh, ZeRO stage and precision the checkpoint was written with, and the
        data position (the data stream is a function of the step).
        """
        metadata = {
            "mesh": self.mesh.as_dict(),
            "zero_stage": self.cfg.zero_stage,
            "dtype": self.cfg.dtype,
            "data_position": self.step,
            "model": self.cfg.model.model_dump(mode="json"),
            **layout_metadata(self.layout, self.shapes),
        }
        step = self.step if step is None else step

        def write(state: dict[str, Any]) -> ucp.Manifest | ucp.SaveHandle:
            return manager.save(state, step, metadata=metadata, mesh=self.mesh.as_dict())

        def state(streamed: TierReader | None, params: bool | ParamCopy) -> dict[str, Any]:
            return self.state_dict_for_checkpoint(streamed, stream_params=params)

        return self._saves.save(state, write, manager.saver)  # waits for the last save's snapshot first

    def prepare_checkpoints(self, manager: ucp.CheckpointManager) -> int:
        """Allocate an asynchronous manager's staging now, so the first checkpoint does not pay for it
        mid-training (:meth:`ucp.CheckpointManager.prepare`); call on every rank. Returns its bytes (0 for a
        synchronous manager, which stages nothing: offloaded state is not read from its tier for it)."""
        if manager.saver is None:
            return 0
        if self._saves.streams_async(manager.saver):
            return 0  # its saves stream the tiers and copy the rest: no staging to allocate
        try:
            return manager.prepare(self.state_dict_for_checkpoint())
        finally:
            self.optimizer.drop_staged()

    def wait_snapshot(self) -> None:
        """Wait for the copy of the last asynchronous checkpoint (it may still run in the background:
        ``CheckpointManager(snapshot="background")``) and for the copies of the swap files it streams; the engine
        calls it before changing its state."""
        self._saves.wait_snapshot()

    def load(self, source: ucp.CheckpointManager | str | os.PathLike[str], step: int | None = None) -> int:
        """Resume from a checkpoint, whatever mesh and ZeRO stage wrote it; returns the step to train next.

        ``source``: a manager (``step`` or by default its latest checkpoint) or a checkpoint directory.
        Call on every rank: each reads only the regions of the global tensors it holds, in place,
        then the compute weights are re-derived from the loaded fp32 masters.

        Before anything is overwritten, the checkpoint must fit this engine
        (:func:`training.compat.check_resumable`: model tensors and config, data seed; a checkpoint the
        manager falls back to is checked once read, so a misfit there leaves this rank's state
        overwritten: load again). Every rank
        resumes from the same checkpoint: a manager falls back to an older checkpoint on its own, per
        rank, when one does not load there (a corrupt piece only that rank reads), so the ranks compare
        the steps they loaded and, if these differ, all load the oldest of them. A rank that fails
        makes every rank raise, rather than leave the others waiting in a collective.
        """
        self.wait_snapshot()
        if step is not None and not isinstance(source, ucp.CheckpointManager):
            raise TypeError("step= selects a checkpoint of a manager; give a checkpoint directory alone")
        into = self._load_targets()
        loaded, error = self._read_checkpoint(source, step, into)
        oldest, newest = self._loaded_range(loaded)
        if oldest != newest and oldest != FAILED:  # the ranks read different checkpoints of the manager
            if loaded != oldest:
                loaded, error = self._read_checkpoint(source, oldest, into)
            oldest, newest = self._loaded_range(loaded)
        if error is not None:
            raise error
        if oldest == FAILED:
            raise ucp.CheckpointError(
                f"another rank could not load its part of {_describe(source)} (see that rank's error); no rank resumed"
            )
        written, self._weights_written = self._weights_written, False
        if written:  # the masters went to the tier, their casts to the parameter tier
            self.finish_load(into, from_masters=True, weights_written=True)
        elif self.optimizer.offload is None:
            self.finish_load(into, from_masters=True)
        else:  # the masters went to the tier, their casts to these: the weights come from them
            casts, self._loaded_casts = self._loaded_casts, None
            self.finish_load(into, from_masters=True, casts=casts)
        return self.step

    def _load_targets(self) -> dict[str, Any]:
        """What a resume fills: this rank's pieces and the scalars. Hparams and the scheduler
        description stay this engine's own; plain values (None) are replaced by the saved ones.
        Offloaded optimizer states are not among them: :meth:`_fill_tier` streams them into the tier. Nor are
        the weights with ``offload_param`` nvme: they are the loaded masters' casts, streamed into the parameter
        tier (:meth:`_fill_tier`, or :meth:`ZeroOptimizer.publish` from masters in memory), never staged whole."""
        offload, params = self.optimizer.offload, self.optimizer.param_tier
        if offload is not None or params is not None:
            nested, found = offloaded_layout(
                self.optimizer, self.shapes, states=offload is not None, params=params is not None
            )
            self._spans = {k: v for k, v in found.items() if k in STATE_KEYS}
            scalars = {"adam_step": None, "loss_scale": None}
            into: dict[str, Any] = {"step": None, "optimizer": scalars}
            if params is None:
                into["model"] = nested.get("model", {})
            if offload is None:  # the optimizer's states in memory: filled in place
                scalars |= {k: nested.get(k, {}) for k in STATE_KEYS}
            return into
        self.optimizer.prepare_load()
        sd = self.state_dict_for_checkpoint()
        optim = {k: sd["optimizer"][k] for k in ("fp32_master", "exp_avg", "exp_avg_sq")}
        return {"model": sd["model"], "step": None, "optimizer": {**optim, "adam_step": None, "loss_scale": None}}

    def _fill_tier(self, path: str, aio_config: Any = None) -> None:
        """Offload on: stream the checkpoint's masters and moments at ``path`` into the tier, sub-group by
        sub-group (training.offload.checkpoint.fill_tier), their casts into the compute weights' targets."""
        offload = self.optimizer.offload
        if offload is None:
            return
        params = self.optimizer.param_tier
        if params is None:
            casts = self.optimizer.cast_targets()
            load_tier(offload, self._spans, path, casts=casts, aio_config=aio_config)
            self._loaded_casts = casts
            return
        # offload_param nvme: the weights go from the loaded masters to the parameter tier, streamed (no whole cast)
        load_tier(offload, self._spans, path, casts=[None] * len(self.optimizer.plans), aio_config=aio_config)
        with TierReader(offload) as reader:
            params.write_from(partial(reader.parts, 0))
        self._weights_written = True

    def _read_checkpoint(
        self, source: ucp.CheckpointManager | str | os.PathLike[str], step: int | None, into: dict[str, Any]
    ) -> tuple[int, Exception | None]:
        """Check the checkpoint against this engine, then fill ``into`` from it. Returns (the manager's
        step that was read, or the saved step of a directory; None) or (FAILED, the error): the error is
        raised by :meth:`load` once every rank has told the others how it went."""
        try:
            if not isinstance(source, ucp.CheckpointManager):
                self._check_fits(os.fspath(source))
                _no_missing_keys(ucp.load(source, into=into, strict=False))
                self._fill_tier(os.fspath(source))
                return int(into["step"]), None
            chosen = source.latest() if step is None else step
            if chosen is not None:
                self._check_fits(source.path(chosen))
            _no_missing_keys(source.load(step, into=into, strict=False))
            loaded = source.loaded_step
            assert loaded is not None
            where, options = source.loaded_location()  # a tiered manager may have read the remote copy
            if loaded != chosen or where != source.path(loaded):  # checked only once read: a fallback
                self._check_fits(where, options)
            try:
                self._fill_tier(where, source.aio_config)
            except (ucp.CheckpointError, OSError) as exc:
                older = [i.step for i in source.list() if i.status == "complete" and i.step < loaded]
                if step is not None or not older:
                    raise
                log.warning("cannot load %s (%s); trying an older checkpoint", source.path(loaded), exc)
                return self._read_checkpoint(source, max(older), into)  # as the manager falls back
            return loaded, None
        except Exception as exc:  # noqa: BLE001 - raised by load() after the ranks compared notes
            return FAILED, exc

    def _check_fits(self, path: str, storage_options: dict[str, Any] | None = None) -> None:
        manifest = ucp.read_manifest(path, storage_options=storage_options)
        check_resumable(manifest, path, self.cfg.model, self.shapes, self.cfg.data_seed)

    def _loaded_range(self, loaded: int) -> tuple[int, int]:
        """The oldest and newest step the ranks of this run loaded (FAILED, -1, is the oldest of all)."""
        low = torch.tensor([loaded], dtype=torch.int64, device=self.device)
        high = low.clone()
        self.mesh.world.all_reduce(low, op=dist.ReduceOp.MIN)
        self.mesh.world.all_reduce(high, op=dist.ReduceOp.MAX)
        return int(low.item()), int(high.item())


FAILED = -1  # the step a rank reports when it could not load (steps are >= 0)


def _describe(source: ucp.CheckpointManager | str | os.PathLike[str]) -> str:
    if isinstance(source, ucp.CheckpointManager):
        return f"the checkpoints under {source.root}"
    return f"checkpoint {os.fspath(source)}"


def _no_missing_keys(report: ucp.LoadReport) -> None:
    """A load into this rank's part of the state is not strict about the checkpoint's other keys (a ZeRO
    rank's ``into`` holds only its own partitions of the fp32 masters and moments); a key of ``into`` that
    the checkpoint lacks is still an error, as a strict load would make it."""
    if report.missing:
        names = ", ".join(path_str(p) for p in report.missing[:12])
        more = f" and {len(report.missing) - 12} more" if len(report.missing) > 12 else ""
        raise ucp.LayoutMismatchError(f"the checkpoint lacks {names}{more}")
