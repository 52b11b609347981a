"""Offload settings with DeepSpeed's key names and meanings, so a DeepSpeed JSON config works unchanged.

:meth:`OffloadConfig.from_deepspeed` reads a whole DeepSpeed config (or its ``zero_optimization``
section): ``zero_optimization.offload_optimizer``, ``zero_optimization.offload_param``,
``zero_optimization.sub_group_size``, ``zero_optimization.stage`` and the top-level ``aio`` section.
Every other ``zero_optimization`` key is one of three kinds (docs/offload.md lists them):

* :data:`IGNORED_ZERO_KEYS` tune DeepSpeed's internals (bucket sizes, its stage-3 fetch heuristics):
  logged as ignored, whatever their value;
* :data:`UNSUPPORTED_ZERO_KEYS` change what DeepSpeed computes or stores (quantized weights, hpZ):
  accepted at DeepSpeed's default value, refused otherwise;
* anything else is refused with an error naming the key (a typo must not pass silently).

Defaults differ from DeepSpeed's where DeepSpeed's are traps (docs/offload.md says why):
``sub_group_size`` 1e7 elements (DeepSpeed: 1e9, one sub-group for any model under a billion
parameters: nothing to overlap), ``buffer_count`` 12 (DeepSpeed: 4, one sub-group's tensors: the
read of the next sub-group cannot start before the previous one is written back) and
``pipeline_read``/``pipeline_write`` on (DeepSpeed: off).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from aio.config import AioConfig
from aio.sizes import parse_size

log = logging.getLogger(__name__)

Device = Literal["none", "cpu", "nvme"]

# Tensors of one optimizer sub-group in the swap tier: fp32 master, exp_avg, exp_avg_sq. DeepSpeed counts
# the gradient too (its Adam needs 4 buffers per sub-group); here gradients stay in the gradient buffer.
STATE_TENSORS = 3

IGNORED_ZERO_KEYS: dict[str, str] = {
    "contiguous_gradients": "gradients always land in one flat buffer per group",
    "reduce_scatter": "reductions follow the ZeRO stage",
    "reduce_bucket_size": "stage-2 buckets are whole partitions",
    "allgather_partitions": "weights are all-gathered per group",
    "allgather_bucket_size": "weights are all-gathered per group",
    "overlap_comm": "reductions always run asynchronously during backward",
    "use_multi_rank_bucket_allreduce": "a DeepSpeed bucketing detail",
    "round_robin_gradients": "a DeepSpeed gradient-copy ordering detail",
    "ignore_unused_parameters": "parameters without a gradient are skipped",
    "load_from_fp32_weights": "a resume always re-derives weights from the fp32 masters",
    "elastic_checkpoint": "every checkpoint is universal (any world size)",
    "stage3_prefetch_bucket_size": "stage 3 prefetches the next module in the recorded order",
    "prefetch_bucket_size": "stage 3 prefetches the next module in the recorded order",
    "stage3_param_persistence_threshold": "every stage-3 parameter is partitioned",
    "param_persistence_threshold": "every stage-3 parameter is partitioned",
    "stage3_model_persistence_threshold": "every stage-3 parameter is partitioned",
    "model_persistence_threshold": "every stage-3 parameter is partitioned",
    "stage3_max_live_parameters": "stage 3 releases each module's parameters after use",
    "max_live_parameters": "stage 3 releases each module's parameters after use",
    "stage3_max_reuse_distance": "stage 3 releases each module's parameters after use",
    "max_reuse_distance": "stage 3 releases each module's parameters after use",
    "stage3_module_granularity_threshold": "a DeepSpeed hook-placement heuristic",
    "module_granularity_threshold": "a DeepSpeed hook-placement heuristic",
    "stage3_use_all_reduce_for_fetch_params": "parameters are fetched with all_gather",
    "use_all_reduce_for_fetch_params": "parameters are fetched with all_gather",
    "stage3_allgather_sequential": "a DeepSpeed all-gather ordering detail",
    "allgather_sequential": "a DeepSpeed all-gather ordering detail",
    "stage3_gather_16bit_weights_on_model_save": "UCP checkpoints hold the global tensors anyway",
    "gather_16bit_weights_on_model_save": "UCP checkpoints hold the global tensors anyway",
    "stage3_gather_fp16_weights_on_model_save": "UCP checkpoints hold the global tensors anyway",
    "memory_efficient_linear": "a DeepSpeed autograd-function detail",
    "override_module_apply": "a DeepSpeed module-patching detail",
    "log_trace_cache_warnings": "DeepSpeed's own logging",
    "enable_sanity_checks": "DeepSpeed's own debugging checks",
    "pipeline_loading_checkpoint": "a DeepSpeed checkpoint-loading detail",
}

# Keys that change what DeepSpeed computes or stores; accepted only at DeepSpeed's default (the value here).
UNSUPPORTED_ZERO_KEYS: dict[str, Any] = {
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "legacy_stage1": False,
    "parameter_alignment": False,
    "compute_grad_norm": True,
    "zenflow": None,
    "mics_shard_size": -1,
    "mics_hierarchical_params_gather": False,
    "save_muon_momentum_buffer_in_memory": False,
    "leaf_module": None,
}

# Keys of offload_optimizer that only tune DeepSpeed's internals.
IGNORED_OPTIMIZER_KEYS: dict[str, str] = {
    "fast_init": "the swap files are written once at start-up, pipelined",
    "super_offload": "a DeepSpeed Superchip (GH200) mode",
    "cpuadam_cores_perc": "Adam uses torch's thread count (a DeepSpeed Superchip tuning)",
}


class _Section(BaseModel):
    """A DeepSpeed config section: unknown keys refused (pydantic names them), values validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class OffloadOptimizerConfig(_Section):
    """``zero_optimization.offload_optimizer``: where the fp32 masters and Adam moments live between steps.

    ``device``: ``none`` (in memory, beside the weights), ``cpu`` (host memory, pinned where a GPU exists
    and ``pin_memory``), ``nvme`` (swap files under ``nvme_path``, streamed through ``aio`` every step).
    ``buffer_count``: as in DeepSpeed, buffers of one sub-group's tensor each; a sub-group here takes
    :data:`STATE_TENSORS` of them, so ``buffer_count // 3`` sub-groups are in flight (at least one).
    ``ratio``: as in DeepSpeed, the fraction of the optimizer state offloaded; NVMe tier: at most that fraction
    of the sub-groups is swapped, the others stay resident in host memory (counted in ``swap_budget``). The CPU
    tier keeps every sub-group in host memory whatever the ratio.
    """

    device: Device = "none"
    nvme_path: Path | None = None
    pin_memory: bool = True
    buffer_count: int = Field(12, ge=1)
    pipeline_read: bool = True
    pipeline_write: bool = True
    ratio: float = Field(1.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _path(self) -> "OffloadOptimizerConfig":
        if self.device == "nvme" and self.nvme_path is None:
            raise ValueError("device 'nvme' needs nvme_path (a directory on the device to swap to)")
        return self

    @property
    def slots(self) -> int:
        """Sub-groups the swap pool holds at once (before a byte budget caps them)."""
        return max(1, self.buffer_count // STATE_TENSORS)


class OffloadParamConfig(_Section):
    """``zero_optimization.offload_param`` (ZeRO-3): where parameter partitions live, with DeepSpeed's meanings
    (``nvme``: training.offload.params; ``cpu``: a CPU engine's, where they already are). Defaults differ where
    DeepSpeed's are traps (docs/offload.md): ``max_in_cpu`` 0 (DeepSpeed: 1e9 elements kept in host memory, so
    any model under a billion parameters per rank never has a parameter on the device), ``buffer_size`` 1e7
    (DeepSpeed: 1e8, there so that the largest parameter fits one buffer; here a larger one is split, and
    5 × 1e8 elements is a 1 GB pool in bf16)."""

    device: Device = "none"
    nvme_path: Path | None = None
    pin_memory: bool = True
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(10_000_000, ge=0)
    max_in_cpu: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _path(self) -> "OffloadParamConfig":
        if self.device == "nvme" and self.nvme_path is None:
            raise ValueError("device 'nvme' needs nvme_path (a directory on the device to swap to)")
        return self


class OffloadConfig(_Section):
    """Everything the offload tiers run with (an :class:`training.EngineConfig` field, ``offload``).

    ``swap_budget``: the most bytes the NVMe tier's buffer pool may hold (UCP's own key: DeepSpeed
    sizes the pool from ``buffer_count`` alone); the pool is ``buffer_count // 3`` sub-group buffers,
    fewer where the budget holds fewer, and an error where it holds not even one. ``zero_stage``: the
    stage a DeepSpeed config named, checked against the engine's (None: not given).
    ``keep_resident`` (UCP's own key, NVMe tier with a budget): the budget beyond the pool's pipeline slots
    keeps whole sub-groups resident in host memory, never swapped, so each step moves fewer bytes
    (training.offload.store); False swaps every sub-group (the whole budget goes to the pool's slots).
    """

    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()
    sub_group_size: int = Field(10_000_000, ge=1)
    aio: AioConfig = AioConfig()
    swap_budget: int | None = None
    keep_resident: bool = True
    zero_stage: int | None = Field(None, ge=0, le=3)

    @field_validator("swap_budget", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return None if v is None else parse_size(v, what="swap_budget")

    @property
    def enabled(self) -> bool:
        return self.offload_optimizer.device != "none"

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any], **overrides: Any) -> "OffloadConfig":
        """Read a DeepSpeed config dict (whole, or its ``zero_optimization`` section); ``overrides`` are
        UCP's own keys (``swap_budget``, ``keep_resident``). Raises ValueError naming the key at fault."""
        if not isinstance(config, dict):
            raise ValueError(f"a DeepSpeed config must be a JSON object, got {type(config).__name__}")
        whole = "zero_optimization" in config or "aio" in config
        zero = config.get("zero_optimization", {}) if whole else config
        where = "zero_optimization" if whole else "the zero_optimization section"
        if not isinstance(zero, dict):
            raise ValueError(f"zero_optimization must be a JSON object, got {type(zero).__name__}")
        fields: dict[str, Any] = dict(overrides)
        optimizer: dict[str, Any] = {}
        param: dict[str, Any] = {}
        for key, value in zero.items():
            if key == "stage":
                fields["zero_stage"] = value
            elif key == "sub_group_size":
                fields["sub_group_size"] = value
            elif key == "offload_optimizer":
                optimizer.update(_optimizer_section(value, f"{where}.offload_optimizer"))
            elif key == "offload_param":
                param.update(_section(value, f"{where}.offload_param"))
            elif key == "cpu_offload":  # DeepSpeed's deprecated spelling of offload_optimizer.device cpu
                if value:
                    optimizer.setdefault("device", "cpu")
            elif key == "cpu_offload_param":
                if value:
                    param.setdefault("device", "cpu")
            elif key == "cpu_offload_use_pin_memory":
                if value is not None:
                    optimizer.setdefault("pin_memory", bool(value))
                    param.setdefault("pin_memory", bool(value))
            elif key in IGNORED_ZERO_KEYS:
                log.info("%s.%s=%r ignored: %s", where, key, value, IGNORED_ZERO_KEYS[key])
            elif key in UNSUPPORTED_ZERO_KEYS:
                if value != UNSUPPORTED_ZERO_KEYS[key]:
                    raise ValueError(
                        f"{where}.{key}={value!r} is not supported (only DeepSpeed's default "
                        f"{UNSUPPORTED_ZERO_KEYS[key]!r} is accepted)"
                    )
            else:
                raise ValueError(f"{where}.{key}: unknown key (see docs/offload.md for the keys read)")
        if optimizer:
            fields["offload_optimizer"] = _validated(OffloadOptimizerConfig, optimizer, f"{where}.offload_optimizer")
        if param:
            fields["offload_param"] = _validated(OffloadParamConfig, param, f"{where}.offload_param")
        if whole and config.get("aio") is not None:
            try:
                fields["aio"] = AioConfig.from_deepspeed(config["aio"])
            except ValidationError as exc:
                raise ValueError(f"aio: {_first_error(exc)}") from None
        return _validated(cls, fields, where)


def _section(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(value).__name__}")
    return dict(value)


def _optimizer_section(value: Any, where: str) -> dict[str, Any]:
    out = _section(value, where)
    for key in list(out):
        if key in IGNORED_OPTIMIZER_KEYS:
            log.info("%s.%s=%r ignored: %s", where, key, out.pop(key), IGNORED_OPTIMIZER_KEYS[key])
    return out


def _validated(model: type[BaseModel], data: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{where}: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    """The first of pydantic's errors as ``key.path: message`` (an unknown key: 'unknown key')."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
    return f"{loc}: {msg}" if loc else msg
