"""A whole DeepSpeed JSON config, read with DeepSpeed's key names and meanings, for :func:`training.initialize`.

Top-level keys read: ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps`` (any two give the third, as in DeepSpeed), ``optimizer`` (type ``Adam`` or
``AdamW``; params ``lr``, ``betas``, ``eps``, ``weight_decay``, ``adam_w_mode``), ``bf16`` / ``fp16``
(``enabled`` and fp16's loss-scale keys), ``gradient_clipping``, ``checkpoint`` (``writer.decoupled``: decoupled
saves; the rest: :data:`CHECKPOINT_IGNORED`, :data:`CHECKPOINT_UNSUPPORTED`), ``zero_optimization`` and ``aio``. The
last two go to :meth:`training.offload.OffloadConfig.from_deepspeed`, which owns the policy for their
keys. The same policy holds here: :data:`IGNORED_KEYS` only tune DeepSpeed's internals or its logging
and are logged as ignored; :data:`UNSUPPORTED_KEYS` change what DeepSpeed computes and are accepted at
DeepSpeed's default only; any other key is an error naming it (docs/deepspeed-config.md lists them).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .adam import AdamConfig
from .offload import OffloadConfig
from .zero import LossScaleConfig

log = logging.getLogger(__name__)

IGNORED_KEYS: dict[str, str] = {
    "steps_per_print": "DeepSpeed's own progress logging",
    "wall_clock_breakdown": "DeepSpeed's own timers",
    "memory_breakdown": "DeepSpeed's own memory logging",
    "dump_state": "DeepSpeed's own debugging output",
    "flops_profiler": "DeepSpeed's profiler",
    "tensorboard": "DeepSpeed's monitors",
    "wandb": "DeepSpeed's monitors",
    "csv_monitor": "DeepSpeed's monitors",
    "comet": "DeepSpeed's monitors",
    "comms_logger": "DeepSpeed's communication logger",
    "zero_allow_untested_optimizer": "the optimizer is always UCP's own Adam(W)",
    "zero_force_ds_cpu_optimizer": "the optimizer is always UCP's own Adam(W)",
}

_COMPUTES = "it changes what DeepSpeed computes; the engine computes what DeepSpeed's default does"
# Keys that change what DeepSpeed computes: (DeepSpeed's default, the only value accepted; why, or what to do instead).
UNSUPPORTED_KEYS: dict[str, tuple[Any, str]] = {
    "prescale_gradients": (False, _COMPUTES),
    "gradient_predivide_factor": (1.0, _COMPUTES),
    "sparse_gradients": (False, _COMPUTES),
    "communication_data_type": (None, _COMPUTES),
    "seq_parallel_communication_data_type": (None, _COMPUTES),
    "scheduler": (None, "pass lr_scheduler= to training.initialize"),
    "amp": (None, _COMPUTES),
    "data_types": (None, _COMPUTES),
}

FP16_IGNORED: dict[str, str] = {
    "hysteresis": "the scale halves at the first overflow",
    "consecutive_hysteresis": "the scale halves at the first overflow",
}
_OWN_WRITER = "it tunes DeepSpeed's own checkpoint writer (checkpoints here are written by UCP's)"
CHECKPOINT_IGNORED: dict[str, str] = {
    "tag_validation": "the ranks' tags are always compared: a checkpoint is one directory, so different tags are an error",
    "checkpoint_serialization": _OWN_WRITER,
    "load_universal": "every UCP checkpoint loads at any world size, ZeRO stage and offload setting",
    "parallel_write": "every rank writes its own part of a UCP checkpoint already",
}
WRITER_IGNORED: dict[str, str] = {
    k: _OWN_WRITER
    for k in ("type", "io_buffer_size", "io_buffer_double", "show_statistics", "data_parallel", "io_multiplier")
}
# Keys of ``checkpoint`` that change where or what DeepSpeed writes: (DeepSpeed's default, the only value accepted; why).
CHECKPOINT_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "use_node_local_storage": (False, "the ranks save into one shared directory"),
}

OPTIMIZER_IGNORED: dict[str, str] = {"torch_adam": "the update is always kernels.adam (torch.optim's arithmetic)"}
OPTIMIZER_FIXED: dict[str, Any] = {"amsgrad": False, "bias_correction": True}


class DeepSpeedConfig(BaseModel):
    """What :class:`training.ModuleEngine` runs with, read from a DeepSpeed config by :meth:`from_deepspeed`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch: int = Field(1, ge=1, description="train_micro_batch_size_per_gpu")
    grad_accum: int = Field(1, ge=1, description="gradient_accumulation_steps: micro-batches per optimizer step")
    train_batch_size: int = Field(1, ge=1, description="micro_batch · grad_accum · world size")
    adam: AdamConfig = AdamConfig()
    optimizer: Literal["Adam", "AdamW"] = "AdamW"
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: LossScaleConfig = LossScaleConfig()
    clip: float | None = Field(None, gt=0, description="gradient_clipping (0 in DeepSpeed: none)")
    zero_stage: int = Field(0, ge=0, le=3)
    offload: OffloadConfig = OffloadConfig()
    decoupled_save: bool = Field(
        False,
        description="checkpoint.writer.decoupled: save_checkpoint returns once the state is snapshotted; the "
        "checkpoint is written and committed in the background (ModuleEngine.save_checkpoint)",
    )

    @classmethod
    def load(
        cls, config: dict[str, Any] | str | os.PathLike[str], world_size: int = 1, **overrides: Any
    ) -> "DeepSpeedConfig":
        """A DeepSpeed config as a dict or a JSON file's path; ``overrides``: UCP's own offload keys (``swap_budget``)."""
        if isinstance(config, (str, os.PathLike)):
            path = Path(config)
            try:
                data = json.loads(path.read_text())
            except OSError as exc:
                raise ValueError(f"DeepSpeed config {path}: {exc.strerror or exc}") from None
            except json.JSONDecodeError as exc:
                raise ValueError(f"DeepSpeed config {path}: not JSON ({exc})") from None
            try:
                return cls.from_deepspeed(data, world_size, **overrides)
            except ValueError as exc:
                raise ValueError(f"DeepSpeed config {path}: {exc}") from None
        return cls.from_deepspeed(config, world_size, **overrides)

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any], world_size: int = 1, **overrides: Any) -> "DeepSpeedConfig":
        """Read a whole DeepSpeed config dict; raises ValueError naming the key at fault."""
        if not isinstance(config, dict):
            raise ValueError(f"a DeepSpeed config must be a JSON object, got {type(config).__name__}")
        fields: dict[str, Any] = {}
        batch: dict[str, int | None] = {k: None for k in _BATCH_KEYS}
        for key, value in _read_keys("", config, _TOP_KEYS, IGNORED_KEYS, UNSUPPORTED_KEYS).items():
            if key in _BATCH_KEYS:
                batch[key] = _positive_int(value, key)
            elif key == "optimizer":
                fields.update(_optimizer(value))
            elif key in ("bf16", "bfloat16"):
                if _enabled(value, key, ()):
                    fields["dtype"] = _one_precision(fields, "bf16", key)
            elif key == "fp16":
                if _enabled(value, key, _FP16_KEYS):
                    fields["dtype"] = _one_precision(fields, "fp16", key)
                    fields["loss_scale"] = _loss_scale(value)
            elif key == "gradient_clipping":
                if not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(f"gradient_clipping={value!r}: a number >= 0 (0: no clipping)")
                fields["clip"] = float(value) if value > 0 else None
            elif key == "checkpoint":
                fields.update(_checkpoint(value))
            else:  # zero_optimization, aio: below, through OffloadConfig.from_deepspeed (a key of _TOP_KEYS: a branch)
                assert key in ("zero_optimization", "aio"), f"{key}: in _TOP_KEYS but read nowhere"
        zero: dict[str, Any] = {k: config[k] for k in ("zero_optimization", "aio") if k in config}
        zero.setdefault("zero_optimization", {})
        offload = OffloadConfig.from_deepspeed(zero, **overrides)
        fields["offload"] = offload
        fields["zero_stage"] = offload.zero_stage or 0
        micro, accum, total = _batch_sizes(batch, world_size)
        fields.update(micro_batch=micro, grad_accum=accum, train_batch_size=total)
        return cls.model_validate(fields)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_TOP_KEYS = (
    *_BATCH_KEYS,
    "optimizer",
    "bf16",
    "bfloat16",
    "fp16",
    "gradient_clipping",
    "checkpoint",
    "zero_optimization",
    "aio",
)
_FP16_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale", "auto_cast", *FP16_IGNORED)


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: a positive integer")
    return value


def _disabled(value: Any) -> bool:
    return isinstance(value, dict) and value.get("enabled") is False


def _enabled(value: Any, key: str, allowed: tuple[str, ...]) -> bool:
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object, got {type(value).__name__}")
    for k in value:
        if k != "enabled" and k not in allowed:
            raise ValueError(f"{key}.{k}: unknown key (see docs/deepspeed-config.md for the keys read)")
    enabled = value.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"{key}.enabled={enabled!r}: true or false")
    return enabled


def _one_precision(fields: dict[str, Any], dtype: str, key: str) -> str:
    if fields.get("dtype", dtype) != dtype:
        raise ValueError(f"{key}: bf16 and fp16 are both enabled; enable one")
    return dtype


def _loss_scale(section: dict[str, Any]) -> LossScaleConfig:
    """fp16's dynamic loss scaling: ``initial_scale_power``, ``loss_scale_window``, ``min_loss_scale``."""
    for k in FP16_IGNORED:
        if k in section:
            log.info("fp16.%s=%r ignored: %s", k, section[k], FP16_IGNORED[k])
    if section.get("loss_scale", 0) != 0:
        raise ValueError(f"fp16.loss_scale={section['loss_scale']!r}: only 0 (dynamic loss scaling) is supported")
    if section.get("auto_cast", False):
        raise ValueError("fp16.auto_cast=true is not supported (the module runs in fp16 as a whole)")
    try:
        return LossScaleConfig(
            initial=2.0 ** section.get("initial_scale_power", 16),
            growth_interval=section.get("loss_scale_window", 1000),
            min_scale=section.get("min_loss_scale", 1),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"fp16: {exc}") from None


def _read_keys(
    where: str,
    section: dict[str, Any],
    read: tuple[str, ...],
    ignored: dict[str, str],
    unsupported: dict[str, tuple[Any, str]],
) -> dict[str, Any]:
    """The keys of ``section`` (named ``where`` + key in errors and logs) that the caller reads (``read``), in order;
    the others by DeepSpeed's key policy: ``ignored`` ones logged with the reason, ``unsupported`` ones accepted only
    at DeepSpeed's default (or empty, or disabled), any other an error naming it."""
    for k, v in section.items():
        if k in read:
            continue
        if k in ignored:
            log.info("%s%s=%r ignored: %s", where, k, v, ignored[k])
        elif k in unsupported:
            default, why = unsupported[k]
            if v != default and v != {} and not _disabled(v):
                raise ValueError(
                    f"{where}{k}={v!r} is not supported (only DeepSpeed's default {default!r} is accepted: {why})"
                )
        else:
            raise ValueError(f"{where}{k}: unknown key (see docs/deepspeed-config.md for the keys read)")
    return {k: v for k, v in section.items() if k in read}


def _checkpoint(section: Any) -> dict[str, Any]:
    """``{"writer": {"decoupled": bool, ...}, ...}`` (None: DeepSpeed's defaults): decoupled saves; the keys that
    tune DeepSpeed's own writer are logged as ignored; any other key is an error naming it."""
    if not _object_or_none("checkpoint", section):
        return {}
    read = _read_keys("checkpoint.", section, ("writer",), CHECKPOINT_IGNORED, CHECKPOINT_UNSUPPORTED)
    writer: Any = read.get("writer")
    if not _object_or_none("checkpoint.writer", writer):  # DeepSpeed's default: no writer section
        return {}
    read = _read_keys("checkpoint.writer.", writer, ("decoupled",), WRITER_IGNORED, {})
    if "decoupled" not in read:
        return {}
    if not isinstance(read["decoupled"], bool):
        raise ValueError(f"checkpoint.writer.decoupled={read['decoupled']!r}: true or false")
    return {"decoupled_save": read["decoupled"]}


def _object_or_none(where: str, section: Any) -> bool:
    """Whether ``section`` is a JSON object (None: absent, DeepSpeed's defaults); anything else is an error."""
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(section).__name__}")
    return section is not None


def _optimizer(section: Any) -> dict[str, Any]:
    """``{"type": "Adam"|"AdamW", "params": {...}}``. As in DeepSpeed, type ``Adam`` is AdamW (decoupled
    weight decay) unless ``adam_w_mode`` is false."""
    if not isinstance(section, dict):
        raise ValueError(f"optimizer must be a JSON object, got {type(section).__name__}")
    for k in section:
        if k not in ("type", "params"):
            raise ValueError(f"optimizer.{k}: unknown key (the keys are type and params)")
    kind = section.get("type")
    names = {"adam": "Adam", "adamw": "AdamW"}
    if not isinstance(kind, str) or kind.lower() not in names:
        raise ValueError(f"optimizer.type={kind!r}: only Adam and AdamW are supported")
    kind = names[kind.lower()]
    params = section.get("params", {}) or {}
    if not isinstance(params, dict):
        raise ValueError(f"optimizer.params must be a JSON object, got {type(params).__name__}")
    adam: dict[str, Any] = {"decoupled": True}
    for k, v in params.items():
        if k in ("lr", "eps", "weight_decay"):
            adam[k] = v
        elif k == "betas":
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                raise ValueError(f"optimizer.params.betas={v!r}: two numbers")
            adam["beta1"], adam["beta2"] = v
        elif k == "adam_w_mode" and kind == "Adam":
            adam["decoupled"] = bool(v)
        elif k in OPTIMIZER_IGNORED:
            log.info("optimizer.params.%s=%r ignored: %s", k, v, OPTIMIZER_IGNORED[k])
        elif k in OPTIMIZER_FIXED:
            if v != OPTIMIZER_FIXED[k]:
                raise ValueError(f"optimizer.params.{k}={v!r} is not supported (only {OPTIMIZER_FIXED[k]!r})")
        else:
            raise ValueError(f"optimizer.params.{k}: unknown key for {kind}")
    try:
        return {"optimizer": kind, "adam": AdamConfig(**adam)}
    except ValueError as exc:
        raise ValueError(f"optimizer.params: {exc}") from None


def _batch_sizes(batch: dict[str, int | None], world: int) -> tuple[int, int, int]:
    """(micro batch, accumulation steps, train batch size) from any of DeepSpeed's three keys, as DeepSpeed derives them."""
    total, micro, accum = (batch[k] for k in _BATCH_KEYS)
    if total is None and micro is None:
        micro = 1  # DeepSpeed requires one of them; the engine does not load data, so a default does no harm
    if total is None:
        assert micro is not None
        accum = accum or 1
        return micro, accum, micro * accum * world
    if micro is None:
        accum = accum or 1
        micro, rest = divmod(total, accum * world)
        if rest or not micro:
            raise ValueError(
                f"train_batch_size {total} is not divisible by gradient_accumulation_steps {accum} × world {world}"
            )
    elif accum is None:
        accum, rest = divmod(total, micro * world)
        if rest or not accum:
            raise ValueError(
                f"train_batch_size {total} is not divisible by train_micro_batch_size_per_gpu {micro} × world {world}"
            )
    if micro * accum * world != total:
        raise ValueError(
            f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} × gradient_accumulation_steps "
            f"{accum} × world {world}"
        )
    return micro, accum, total
