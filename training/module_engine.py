"""``ModuleEngine``: ZeRO 0-3 (and optimizer offload) around any ``nn.Module``, driven like DeepSpeed's engine.

::

    engine = training.initialize(model, config="ds_config.json")
    for batch in data:
        loss = engine(**batch).loss          # forward (DeepSpeedEngine.forward)
        engine.backward(loss)
        engine.step()                        # an optimizer step at each gradient-accumulation boundary
    engine.save_checkpoint("ckpt")           # ckpt/global_step<N>/ (a UCP checkpoint) and ckpt/latest
    engine.close()                           # waits for decoupled saves still being written (this rank's)

The parameters, fp32 masters and Adam moments are owned by a :class:`training.zero.ZeroOptimizer`
(``for_module``: plain data parallelism over the world, one parameter group, weight decay on every
parameter as ``torch.optim.AdamW(model.parameters())`` would apply it). Checkpoints are UCP
checkpoints of the *global* tensors under the module's own parameter names (``model`` section: the
compute-dtype weights, so ``ucp export --format hf`` of a Hugging Face model's checkpoint loads with
``from_pretrained``; ``optimizer``: fp32 masters and moments), so they resume at any world size, ZeRO
stage and offload setting. docs/deepspeed-config.md maps DeepSpeed's names to these.

Decoupled saves (the config's ``checkpoint.writer.decoupled``, or ``decoupled=True`` on a save): the save returns
once the state is snapshotted and an :class:`ucp.AsyncSaver` writes and commits it while training goes on;
``latest`` names the tag once it is committed. Offloaded state is read as :class:`training.saving.InFlightSaves`
says (streamed from copies of NVMe swap files), as :class:`training.Engine` reads it. The ranks agree on each
decoupled save (that it started, and how it ended) at the calls that report it, so they raise its failure at the
same call; :meth:`ModuleEngine.close` alone waits without the other ranks.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

import ucp
from ucp.conversion.placement import layout_metadata
from ucp.format.tree import path_str

from .checkpoint import build_targets
from .comm import Comm
from .ds_config import DeepSpeedConfig
from .offload.checkpoint import Span, TierReader, load_tier, streamed_params, streamed_sections
from .offload.checkpoint import layout as offloaded_layout
from .offload.params import ParamCopy
from .saving import InFlightSaves
from .zero import DynamicLossScaler, ZeroOptimizer
from .zero.optimizer import STATE_KEYS

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LATEST = "latest"  # DeepSpeed's file naming the newest tag in a save_checkpoint directory


class ModuleEngine:
    """One rank's part of a data-parallel run of ``module``; call every method on every rank (they communicate),
    but :meth:`close`, which waits for this rank's saves alone.

    ``lr_scheduler(step) -> lr``: the learning rate of optimizer step ``step`` (0-based); default: the
    config's constant ``lr``. The module's parameters become views of ZeRO's flat buffers (at ZeRO-3,
    empty outside the forward and backward of the module holding them), in the config's precision.
    ``saver``: the :class:`ucp.AsyncSaver` of decoupled saves (its ``mode``, ``max_in_flight``, ``snapshot``;
    shared, not closed by :meth:`close`); default: the engine's own, made at the first decoupled save
    (thread mode, one save in flight) and closed by :meth:`close`.
    """

    def __init__(
        self,
        module: nn.Module,
        config: DeepSpeedConfig,
        *,
        lr_scheduler: Callable[[int], float] | None = None,
        dp: Comm | None = None,
        saver: ucp.AsyncSaver | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.lr_scheduler = lr_scheduler
        self.dp = dp or Comm.world()
        self.shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        self.optimizer = ZeroOptimizer.for_module(
            module,
            stage=config.zero_stage,
            adam=config.adam,
            dp=self.dp,
            dtype=DTYPES[config.dtype],
            clip=config.clip,
            loss_scaler=DynamicLossScaler(config.loss_scale) if config.dtype == "fp16" else None,
            offload=config.offload,
        )
        self.global_steps = 0  # optimizer steps taken (skipped fp16 steps included, as in DeepSpeed)
        self.skipped_steps = 0
        self.micro_steps = 0  # step() calls (micro-batches)
        self.last_stats: dict[str, Any] = {}
        self._saver, self._own_saver = saver, saver is None
        self._saves = InFlightSaves(self.optimizer)  # how a save reads offloaded state; the copies it waits for
        self._decoupled: list[_Decoupled] = []  # decoupled saves not yet reported, oldest first (alike on every rank)
        self._latest_lock = threading.Lock()  # ``latest`` is written by the writer that committed the tag
        self._saves_begun = 0  # save_checkpoint calls, numbering them: ``latest`` never goes back to an older one
        self._latest_written: dict[Path, int] = {}  # ... the one each save_dir's ``latest`` names

    # -- DeepSpeedEngine's accessors -----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.optimizer.device

    @property
    def world_size(self) -> int:
        return self.dp.size

    @property
    def global_rank(self) -> int:
        return self.dp.index

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.config.grad_accum

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.config.zero_stage

    def get_lr(self) -> list[float]:
        return [self._lr(self.global_steps)]

    def get_global_grad_norm(self) -> float | None:
        return self.last_stats.get("grad_norm")

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the weights (an fp16 overflow skips it)."""
        return bool(self.last_stats) and not self.last_stats["skipped"]

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` runs the optimizer."""
        return (self.micro_steps + 1) % self.config.grad_accum == 0

    def train(self, mode: bool = True) -> "ModuleEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ModuleEngine":
        return self.train(False)

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.module.parameters()

    def _lr(self, step: int) -> float:
        return self.lr_scheduler(step) if self.lr_scheduler is not None else self.config.adam.lr

    # -- training ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)``, with ZeRO-3's parameters gathered as its submodules run."""
        with self.optimizer.forward_context():
            out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled() and self.optimizer.gatherer is not None:
            self.optimizer.gatherer.release_all()  # no backward will release them
        return out

    __call__ = forward

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Back-propagate ``loss`` into ZeRO's gradient buffers (reduced over ranks as they fill).

        Gradients are averaged over micro-batches and ranks at the step, so ``loss`` is the micro-batch's
        mean loss, unscaled (DeepSpeed divides it by the accumulation steps itself; so does this)."""
        try:
            self.optimizer.backward(loss)
        except BaseException:
            self.optimizer.reset()
            raise
        return loss

    def step(self) -> None:
        """End a micro-batch; at a gradient-accumulation boundary run the optimizer step (DeepSpeedEngine.step).

        At a boundary it first waits for a decoupled save's snapshot (and its copies of NVMe swap files) to be
        taken, since the step changes the weights; once the step is applied it raises the failure of a decoupled
        save that has failed meanwhile, so the training state is whole. While decoupled saves are in flight the
        ranks agree on that at each boundary (one or two small all-reduces per save reported): call it on every
        rank, as the step's own gradient reduction requires anyway."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self._saves.wait_snapshot()  # a decoupled save's copy must be done before the weights change
        try:
            self.last_stats = self.optimizer.step(lr=self._lr(self.global_steps))
        except BaseException:
            self.optimizer.reset()  # a failed step leaves no gradients to the next (only a load repairs weights)
            raise
        self.global_steps += 1
        self.skipped_steps += int(bool(self.last_stats["skipped"]))
        if self._decoupled:
            self._settle(keep_at_most=None)

    def zero_grad(self) -> None:
        """Nothing to do: the step clears ZeRO's gradient buffers (kept for DeepSpeed scripts that call it)."""

    def close(self) -> None:
        """Wait for this rank's decoupled saves in flight, then release the optimizer offload tier (its swap
        directory is removed) and the engine's own saver; idempotent (a second call does nothing). Raises the first
        failure among those saves on this rank, naming its checkpoint, after releasing everything.

        Not a collective: a rank unwinding from an error of its own may call it (``finally: engine.close()``)
        without the others. The ranks' outcomes of a save agree through the saver's commit handshake (rank 0
        commits only once every rank's part is written), except that a rank may fail waiting for a commit that rank
        0 made: its error says so (:meth:`wait_checkpoints` tells which, as the ranks compare outcomes there)."""
        try:
            self._wait_here()
        finally:
            self._saves.close()
            self.optimizer.close()
            if self._own_saver and self._saver is not None:
                self._saver.close()
                self._saver = None

    destroy = close

    # -- checkpoints ---------------------------------------------------------------------------
    def _buffers(self) -> dict[str, torch.Tensor]:
        """The module's persistent buffers (saved beside the weights under their state_dict names)."""
        params = {id(p) for p in self.module.parameters()}
        return {
            k: v
            for k, v in self.module.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and id(v) not in params
        }

    def state_dict_for_checkpoint(
        self, client_state: Any = None, streamed: TierReader | None = None, *, stream_params: bool | ParamCopy = False
    ) -> dict[str, Any]:
        """``{"model": {name: piece}, "optimizer": {fp32_master, exp_avg, exp_avg_sq: {name: piece}, adam_step,
        loss_scale, hparams}, "global_steps", "skipped_steps", "micro_steps", "client_state"}``; pieces view live
        storage (offloaded state is staged from its tier, or with ``streamed`` read from it by that reader while
        the save writes it: training.offload.checkpoint; ``stream_params``: the parameters on NVMe likewise, from
        their swap files, or from that copy of them: a decoupled save)."""
        tier = self.optimizer.param_tier if stream_params else None
        if streamed is None and tier is None:
            nested = build_targets(self.optimizer.buffers(), self.shapes).nested()
        else:
            nested, found = offloaded_layout(
                self.optimizer, self.shapes, states=streamed is not None, params=tier is not None
            )
            if streamed is not None:
                nested |= streamed_sections({k: found[k] for k in STATE_KEYS}, streamed)
            if tier is not None:
                source = stream_params if isinstance(stream_params, ParamCopy) else None
                nested["model"] = streamed_params(found["model"], tier, source)
        optim: dict[str, Any] = {k: nested.get(k, {}) for k in STATE_KEYS}
        optim |= self.optimizer.scalars()
        a = self.config.adam
        optim["hparams"] = {
            "kind": self.config.optimizer,
            "decoupled": a.decoupled,
            "lr": a.lr,
            "betas": [a.beta1, a.beta2],
            "eps": a.eps,
            "weight_decay": a.weight_decay,
        }
        return {
            "model": {**nested.get("model", {}), **self._buffers()},
            "optimizer": optim,
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
            "micro_steps": self.micro_steps,
            "client_state": client_state,
        }

    def save(
        self, path: str | os.PathLike[str], client_state: Any = None, *, decoupled: bool | None = None
    ) -> ucp.Manifest | ucp.SaveHandle:
        """Write a UCP checkpoint directory at ``path`` (atomically); ``client_state``: any value ucp saves
        (dicts, numbers, strings, tensors), returned by :meth:`load`. Gradients of an unfinished
        accumulation are not saved.

        Call it on every rank. ``decoupled`` (keyword only; default: the config's ``checkpoint.writer.decoupled``):
        return a :class:`ucp.SaveHandle` once the state is snapshotted, the checkpoint written and committed in the
        background (at most the saver's ``max_in_flight`` at once: beyond that this waits for the oldest, and raises
        its failure). A save that fails to start on any rank raises a :class:`ucp.CheckpointError` naming ``path``
        on every rank. A synchronous save first waits for the decoupled saves in flight (:meth:`wait_checkpoints`).
        Either way, a decoupled save's failure raised here means this save was not started."""
        decoupled = self.config.decoupled_save if decoupled is None else decoupled
        metadata = {
            "engine": "training.ModuleEngine",
            "zero_stage": self.config.zero_stage,
            "dtype": self.config.dtype,
            "world_size": self.dp.size,
            **layout_metadata(self.optimizer.layout, self.shapes),
            **hf_metadata(self.module),
        }
        options: dict[str, Any] = {"step": self.global_steps, "metadata": metadata, "mesh": {"dp": self.dp.size}}
        saver = self._async_saver() if decoupled else None
        if saver is not None:
            self._settle(keep_at_most=saver.options.max_in_flight - 1)
        else:
            self.wait_checkpoints()

        reached = False  # whether this rank got as far as its saver (the ranks agree on that before they enter it)

        def write(state: dict[str, Any]) -> ucp.Manifest | ucp.SaveHandle:
            nonlocal reached
            if saver is None:
                return ucp.save(state, path, **options)
            reached = True
            if self._any_rank(False):  # another rank failed before its saver: none enters its collectives
                raise _StartedElsewhere()
            return saver.save(state, path, **options)

        def state(streamed: TierReader | None, params: bool | ParamCopy) -> dict[str, Any]:
            return self.state_dict_for_checkpoint(client_state, streamed, stream_params=params)

        if saver is None:
            return self._saves.save(state, write, None)  # offloaded state streamed from its tier (never all in memory)
        error: Exception | None = None
        try:
            result = self._saves.save(state, write, saver)
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank has said whether its save started
            error = exc
        if error is not None and not reached:  # failed making its copies or state: meet the others before their saver
            self._any_rank(True)
        if self._any_rank(error is not None):  # a handle here but none on another rank: it cannot commit
            mine = error is not None and not isinstance(error, _StartedElsewhere)
            where = f"failed to start: {error}" if mine else "failed to start on another rank (see its error)"
            raise ucp.CheckpointError(
                f"the decoupled save of checkpoint {os.fspath(path)} {where}", file=os.fspath(path)
            ) from (error if mine else None)
        assert isinstance(result, ucp.SaveHandle)
        self._decoupled.append(_Decoupled(result, os.fspath(path)))
        return result

    def wait_checkpoints(self) -> None:
        """Wait for every decoupled save in flight; raises the first failure among them, naming its checkpoint.
        Call it on every rank: the ranks compare each save's outcome (an all-reduce), so every rank raises the
        same failure."""
        self._settle(keep_at_most=0)

    def _async_saver(self) -> ucp.AsyncSaver:
        if self._saver is None:
            self._saver = ucp.AsyncSaver()
        return self._saver

    def _settle(self, *, keep_at_most: int | None) -> None:
        """Report the decoupled saves that are over, oldest first: forget the committed ones, raise the first
        failure (naming the checkpoint). ``keep_at_most``: first wait for the oldest until at most that many are
        in flight (None: wait for none). The ranks agree on each save's outcome (one small all-reduce), so every
        rank forgets or raises the same ones at the same call, and none is left waiting in a collective. A failure
        is raised once the save is over on every rank, saying whether rank 0 had committed it all the same."""
        while self._decoupled:
            oldest = self._decoupled[0]
            if keep_at_most is not None and len(self._decoupled) > keep_at_most:
                oldest.handle.exception()
            running, failed, committed = self._outcome(oldest.handle)
            if running and failed:  # over somewhere: wait for the rest, so rank 0 has committed it or not
                oldest.handle.exception()
                running, failed, committed = self._outcome(oldest.handle)
            if running:
                return
            self._decoupled.pop(0)
            self._saves.release_done()  # its copies of the swap files are gone once it is reported
            error = oldest.handle.exception()
            if error is None and oldest.point_latest is not None:
                oldest.point_latest()
            if failed:
                raise _failure(oldest.path, error, committed=committed)

    def _outcome(self, handle: ucp.SaveHandle) -> tuple[bool, bool, bool]:
        """(running on some rank, failed on some rank, committed by rank 0) of a decoupled save: one all-reduce."""
        done = handle.done()
        error = handle.exception() if done else None
        committed = done and error is None and self.dp.index == 0
        running, failed, committed = (bool(v) for v in self._rank_max([not done, error is not None, committed]))
        return running, failed, committed

    def _wait_here(self) -> None:
        """Wait for this rank's decoupled saves (no collective); raise the first failure among them."""
        pending, self._decoupled = self._decoupled, []
        first: ucp.CheckpointError | None = None
        for d in pending:
            error = d.handle.exception()
            if error is None and d.point_latest is not None:
                d.point_latest()
            elif error is not None and first is None:
                # a rank that failed waiting for rank 0's commit cannot tell whether rank 0 made it
                unsure = self.dp.index != 0 and isinstance(error, ucp.CommitError)
                first = _failure(d.path, error, committed=None if unsure else False)
        if first is not None:
            raise first

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (one all-reduce; every rank must call it)."""
        return bool(self._rank_max([flag])[0])

    def _rank_max(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks (one all-reduce; every rank must call it). float64: exact for any
        32-bit integer."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dp.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def load(self, path: str | os.PathLike[str], *, load_module_only: bool = False) -> Any:
        """Resume from the checkpoint directory at ``path``, whatever world size, ZeRO stage or offload
        wrote it; returns its ``client_state``. ``load_module_only``: the weights alone (masters taken
        from them; moments and counters stay this engine's).

        Each rank reads only the regions it holds. A rank that fails makes every rank raise (naming the
        failing rank's error on that rank), so none is left waiting in a collective. A decoupled save's snapshot
        is taken first (decoupled saves in flight go on).
        """
        self._saves.wait_snapshot()
        self.optimizer.reset()
        offload, params = self.optimizer.offload, self.optimizer.param_tier
        # parameters on NVMe: not load targets (staged whole) but the loaded masters' casts, streamed in below
        stream = params is not None and not load_module_only
        found: dict[str, list[Span]] = {}
        if offload is not None or stream:  # the optimizer states are streamed into the tier after the rest
            nested, found = offloaded_layout(self.optimizer, self.shapes, states=offload is not None, params=stream)
            found = {k: v for k, v in found.items() if k in STATE_KEYS}
            model = self._buffers() if stream else {**nested.get("model", {}), **self._buffers()}
            states = {k: nested.get(k, {}) for k in STATE_KEYS} if offload is None else {}
            sd = {"model": model, "optimizer": states}
        if load_module_only:
            into: dict[str, Any] = {"model": (sd if offload is not None else self.state_dict_for_checkpoint())["model"]}
        else:
            if offload is None and not stream:
                self.optimizer.prepare_load()
                sd = self.state_dict_for_checkpoint()
            # every key the checkpoint holds: the pieces to fill, None for the values to take as saved
            into = {
                "model": sd["model"],
                "optimizer": {
                    **{k: sd["optimizer"][k] for k in STATE_KEYS if k in sd["optimizer"]},
                    "adam_step": None,
                    "loss_scale": None,
                    "hparams": None,
                },
                "global_steps": None,
                "skipped_steps": None,
                "micro_steps": None,
                "client_state": None,
            }
        error: Exception | None = None
        casts: list[torch.Tensor | None] | None = None
        written = False  # the parameter tier holds the loaded masters' casts
        try:
            if (offload is None and not stream) or load_module_only:
                _load_into(path, into, partial=load_module_only)
            else:  # all but the streamed state (a subtree: not strict, but nothing of it may be missing)
                missing = ucp.load(path, into=into, strict=False).missing
                if missing:
                    raise ucp.LayoutMismatchError(f"{os.fspath(path)} lacks {', '.join(map(path_str, missing[:12]))}")
                if offload is not None and params is None:
                    casts = self.optimizer.cast_targets()
                    load_tier(offload, found, path, casts=casts)
                elif offload is not None and params is not None:  # masters to their tier, then their casts to theirs
                    load_tier(offload, found, path, casts=[None] * len(self.optimizer.plans))
                    with TierReader(offload) as reader:
                        params.write_from(lambda g, lo, hi: reader.parts(0, g, lo, hi))
                    written = True
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank has said how it went
            error = exc
        failed = self._any_rank(error is not None)
        if error is not None:
            self.optimizer.drop_staged()
            raise error
        if failed:
            self.optimizer.drop_staged()
            raise ucp.CheckpointError(
                f"another rank could not load its part of checkpoint {os.fspath(path)} (see that rank's error)"
            )
        self.micro_steps = 0
        if load_module_only:
            self.optimizer.masters_from_weights()
            return None
        self.optimizer.load_scalars(into["optimizer"])
        # compute weights from the loaded masters (or their casts, offloaded; or already in the parameter tier)
        self.optimizer.publish(casts, weights_written=written)
        self.global_steps = int(into["global_steps"])
        self.skipped_steps = int(into["skipped_steps"])
        return into["client_state"]

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: Any = None,
        save_latest: bool = True,
        *,
        decoupled: bool | None = None,
    ) -> bool:
        """DeepSpeed's layout: checkpoint ``save_dir/tag`` (default tag ``global_step<N>``) and, with
        ``save_latest``, the tag written to ``save_dir/latest``. Returns True. Call it on every rank, with the same
        tag (the ranks compare it: ValueError on every rank otherwise). A rank 0 that cannot write ``latest`` makes
        every rank raise.

        ``decoupled`` (keyword only; default: the config's ``checkpoint.writer.decoupled``): return once the state
        is snapshotted (:meth:`save`); ``latest`` names the tag once rank 0 has committed the checkpoint (rank 0's
        writer moves it), never before, and never back to an older tag. A decoupled save that fails before rank 0
        commits it leaves the previous checkpoint and ``latest`` as they were; its failure is raised (naming the
        checkpoint) at the next wait point: the next :meth:`save_checkpoint` (or :meth:`save`, which then does not
        start its own save), the next optimizer :meth:`step` (once it is applied), :meth:`wait_checkpoints` or
        :meth:`close`. A rank can fail after rank 0 committed the save (it gave up waiting for the commit): the
        checkpoint is then whole and ``latest`` may name it, and the error says so."""
        tag = tag or f"global_step{self.global_steps}"
        if not tag or "/" in tag or tag in (".", ".."):
            raise ValueError(f"checkpoint tag {tag!r}: a single directory name")
        root = Path(save_dir)
        if self.dp.index == 0:
            root.mkdir(parents=True, exist_ok=True)
        self._agree_on_tag(tag)  # ... and rank 0 made the directory
        self._saves_begun += 1
        begun = self._saves_begun
        result = self.save(root / tag, client_state=client_state, decoupled=decoupled)
        if isinstance(result, ucp.SaveHandle):
            if save_latest and self.dp.index == 0:
                self._decoupled[-1].point_latest = partial(self._point_latest, root, tag, begun, result)
                result.add_done_callback(partial(self._point_latest, root, tag, begun))
            return True
        error: OSError | None = None
        if save_latest and self.dp.index == 0:
            try:
                self._point_latest(root, tag, begun, None)
            except OSError as exc:
                error = exc
        if self._any_rank(error is not None):  # ... and no rank returns before rank 0 wrote latest
            if error is not None:
                raise error
            raise ucp.CheckpointError(
                f"{root / tag} is saved, but rank 0 could not write {root / LATEST} (see its error)",
                file=os.fspath(root / LATEST),
            )
        return True

    def _agree_on_tag(self, tag: str) -> None:
        """Every rank saves the same tag (a checkpoint is one directory): one all-reduce, a barrier too."""
        crc = zlib.crc32(tag.encode())
        high, low = self._rank_max([crc, -crc])
        if high != crc or -low != crc:
            raise ValueError(f"save_checkpoint: the ranks gave different tags (this rank: {tag!r}); give them all one")

    def _point_latest(self, root: Path, tag: str, begun: int, handle: ucp.SaveHandle | None) -> None:
        """Rank 0, once save_checkpoint number ``begun`` committed ``root/tag`` (``handle``: it was decoupled, and
        this runs on the writer that committed it): ``root/latest`` names the tag, unless a later one is named."""
        if handle is not None and handle.exception() is not None:
            return  # not committed: latest stays as it was
        key = root.absolute()
        with self._latest_lock:
            if begun <= self._latest_written.get(key, 0):
                return
            try:
                tmp = root / f".{LATEST}.tmp"
                tmp.write_text(tag)
                os.replace(tmp, root / LATEST)
            except OSError as exc:
                if handle is None:
                    raise
                log.warning("%s is saved, but %s could not name it: %s", root / tag, root / LATEST, exc)
                return
            self._latest_written[key] = begun

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_module_only: bool = False,
        load_optimizer_states: bool = True,
    ) -> tuple[str | None, Any]:
        """DeepSpeed's ``(load path, client_state)``: ``load_dir/tag``, the tag by default read from
        ``load_dir/latest``. Without a tag and a ``latest`` file it returns ``(None, None)`` and loads
        nothing, as DeepSpeed does (a fresh run). ``load_optimizer_states=False``: the weights alone."""
        root = Path(load_dir)
        if tag is None:
            latest = root / LATEST
            if not latest.is_file():
                log.warning("%s: no %r file, nothing loaded (give tag= to load a checkpoint)", root, LATEST)
                return None, None
            tag = latest.read_text().strip()
        path = root / tag
        state = self.load(path, load_module_only=load_module_only or not load_optimizer_states)
        return str(path), state


class _StartedElsewhere(Exception):
    """A decoupled save not started here because another rank failed before it reached its saver."""


@dataclass
class _Decoupled:
    """A decoupled save in flight: its handle, the checkpoint it writes (named by its failure), and (rank 0 of
    save_checkpoint) what names it in ``latest`` once committed: the writer's done-callback does, and a wait point
    makes sure it has (the callback may run after a wait for the handle returned)."""

    handle: ucp.SaveHandle
    path: str
    point_latest: Callable[[], None] | None = None


def _failure(path: str, error: BaseException | None, *, committed: bool | None) -> ucp.CheckpointError:
    """The error a rank raises for the failed decoupled save of ``path``: ``error`` is this rank's (None: it failed on
    another rank only); ``committed``: rank 0 had committed it all the same (None: this rank cannot tell)."""
    where = "failed" if error is not None else "failed on another rank"
    if committed:
        where += " after rank 0 had committed it (the checkpoint is whole, and latest may name it)"
    elif committed is None:
        where += " (rank 0 may have committed it all the same: this rank failed waiting for the commit)"
    why = f": {error}" if error is not None else " (see its error)"
    exc = ucp.CheckpointError(f"the decoupled save of checkpoint {path} {where}{why}", file=path)
    exc.__cause__ = error
    return exc


def hf_metadata(module: nn.Module) -> dict[str, Any]:
    """``{"hf_config": config.json's content}`` for a ``transformers`` model (one with a ``config`` that
    serialises as ``save_pretrained`` writes it), so ``ucp export --format hf`` of the checkpoint writes a
    folder ``from_pretrained`` loads; ``{}`` for any other module."""
    import json

    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return {}
    try:
        doc = json.loads(to_json(use_diff=False))
    except (TypeError, ValueError):
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        return {}
    doc["architectures"] = [type(module).__name__]  # as save_pretrained records it
    return {"hf_config": doc}


def _load_into(path: str | os.PathLike[str], into: dict[str, Any], *, partial: bool) -> None:
    """``ucp.load(path, into=into)``; ``partial``: ``into`` is a subtree of the checkpoint (the weights alone),
    which a strict ``ucp.load`` (where it has ``strict``) would refuse."""
    if partial and "strict" in inspect.signature(ucp.load).parameters:
        ucp.load(path, into=into, strict=False)  # type: ignore[call-overload,unused-ignore]
    else:
        ucp.load(path, into=into)
