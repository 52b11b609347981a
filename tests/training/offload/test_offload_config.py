"""DeepSpeed's offload keys parse unchanged (OffloadConfig.from_deepspeed): values and meanings carried over,
internals-only keys logged as ignored, anything else an error naming the key; UCP's own defaults where
DeepSpeed's are traps; the engine refuses what it cannot run."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest

from training import EngineConfig
from training.models.gpt import PRESETS
from training.offload import OffloadConfig

# A ZeRO-Infinity config as DeepSpeed's tutorials write it.
DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "sub_group_size": 1e7,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 16,
            "pipeline_read": True,
            "pipeline_write": False,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
    },
    "aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 2, "single_submit": False},
}


def test_a_deepspeed_zero_infinity_config_parses_unchanged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="training.offload.config"):
        c = OffloadConfig.from_deepspeed(DS_CONFIG)
    o, p = c.offload_optimizer, c.offload_param
    assert (o.device, o.nvme_path, o.pin_memory, o.buffer_count) == ("nvme", Path("/local_nvme"), True, 16)
    assert (o.pipeline_read, o.pipeline_write, o.slots) == (True, False, 5)
    assert (p.device, p.nvme_path, p.buffer_count, p.buffer_size, p.max_in_cpu) == (
        "nvme",
        Path("/local_nvme"),
        5,
        100_000_000,
        1_000_000_000,
    )
    assert c.sub_group_size == 10_000_000 and c.zero_stage == 3 and c.enabled
    assert (c.aio.block_size, c.aio.queue_depth, c.aio.thread_count) == (1 << 20, 16, 2)
    ignored = caplog.text
    for key in ("contiguous_gradients", "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "fast_init"):
        assert f"{key}=" in ignored and "ignored" in ignored
    assert "sub_group_size" not in ignored and "buffer_count" not in ignored


def test_the_zero_section_alone_parses_too() -> None:
    c = OffloadConfig.from_deepspeed({"stage": 2, "offload_optimizer": {"device": "cpu"}})
    assert c.offload_optimizer.device == "cpu" and c.zero_stage == 2


def test_deepspeeds_own_parser_reads_the_same_values() -> None:
    zero = pytest.importorskip("deepspeed.runtime.zero.config")
    theirs = zero.DeepSpeedZeroConfig(**copy.deepcopy(DS_CONFIG["zero_optimization"]))
    ours = OffloadConfig.from_deepspeed(DS_CONFIG)
    for key in ("device", "nvme_path", "pin_memory", "buffer_count", "pipeline_read", "pipeline_write"):
        assert getattr(ours.offload_optimizer, key) == _plain(getattr(theirs.offload_optimizer, key)), key
    for key in ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"):
        assert getattr(ours.offload_param, key) == _plain(getattr(theirs.offload_param, key)), key
    assert ours.sub_group_size == theirs.sub_group_size


def _plain(v: Any) -> Any:
    return getattr(v, "value", v)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["zero_optimization"].update(stage3_prefetch_bucket_sz=1), r"zero_optimization\.stage3_prefetch_bucket_sz: unknown key"),
        (lambda c: c["zero_optimization"]["offload_optimizer"].update(nvme_pth="/x"), r"zero_optimization\.offload_optimizer: nvme_pth: unknown key"),
        (lambda c: c["zero_optimization"]["offload_param"].update(buffer_sz=1), r"zero_optimization\.offload_param: buffer_sz: unknown key"),
        (lambda c: c["aio"].update(queue_dpth=4), r"aio: queue_dpth: unknown key"),
        (lambda c: c["zero_optimization"]["offload_optimizer"].update(device="disk"), r"offload_optimizer: device: Input should be 'none', 'cpu' or 'nvme'"),
        (lambda c: c["zero_optimization"]["offload_optimizer"].pop("nvme_path"), r"offload_optimizer: .*device 'nvme' needs nvme_path"),
        (lambda c: c["zero_optimization"]["offload_optimizer"].update(ratio=1.5), r"offload_optimizer: ratio: .*less than or equal to 1"),
        (lambda c: c["zero_optimization"]["offload_optimizer"].update(buffer_count=0), r"offload_optimizer: buffer_count: "),
        (lambda c: c["zero_optimization"].update(zero_quantized_weights=True), r"zero_optimization\.zero_quantized_weights=True is not supported"),
        (lambda c: c["zero_optimization"].update(offload_optimizer=["cpu"]), r"zero_optimization\.offload_optimizer must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_keys_and_values_are_named(edit: Any, message: str) -> None:
    c = copy.deepcopy(DS_CONFIG)
    edit(c)
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_deepspeed(c)


def test_unsupported_keys_at_deepspeeds_default_are_accepted() -> None:
    c = OffloadConfig.from_deepspeed(
        {"zero_optimization": {"zero_quantized_weights": False, "zero_hpz_partition_size": 1}}
    )
    assert not c.enabled


def test_deprecated_cpu_offload_keys_mean_what_they_mean_to_deepspeed() -> None:
    c = OffloadConfig.from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": False,
            }
        }
    )
    assert (c.offload_optimizer.device, c.offload_optimizer.pin_memory) == ("cpu", False)
    assert (c.offload_param.device, c.offload_param.pin_memory) == ("cpu", False)


def test_defaults_avoid_deepspeeds_traps() -> None:
    c = OffloadConfig()
    assert c.sub_group_size == 10_000_000  # DeepSpeed: 1e9, one sub-group for most models
    assert c.offload_optimizer.buffer_count == 12 and c.offload_optimizer.slots == 4  # DeepSpeed: 4 = one sub-group
    assert c.offload_optimizer.pipeline_read and c.offload_optimizer.pipeline_write  # DeepSpeed: off
    assert c.aio.block_size == 8 << 20 and c.aio.queue_depth == 32  # no aio section: UCP's aio defaults
    assert OffloadConfig(swap_budget="8MiB").swap_budget == 8 << 20


def test_engine_config_checks_offload_against_the_run() -> None:
    tiny = PRESETS["tiny"]
    with pytest.raises(ValueError, match=r"zero_optimization.stage 3 of the offload config differs from zero_stage 1"):
        EngineConfig(model=tiny, zero_stage=1, offload=OffloadConfig(zero_stage=3))
    with pytest.raises(ValueError, match=r"offload_param.device 'cpu' needs ZeRO stage 3"):
        EngineConfig(model=tiny, zero_stage=2, offload={"offload_param": {"device": "cpu"}})
    with pytest.raises(ValueError, match=r"offload_param.device 'nvme' is not supported yet on cuda"):
        EngineConfig(model=tiny, zero_stage=3, device="cuda", offload=OffloadConfig.from_deepspeed(DS_CONFIG))
    assert EngineConfig(model=tiny, zero_stage=3, offload=OffloadConfig.from_deepspeed(DS_CONFIG)).zero_stage == 3
    ok = EngineConfig(model=tiny, zero_stage=3, offload={"offload_param": {"device": "cpu"}})
    assert ok.offload.offload_param.device == "cpu"  # a CPU engine's parameters already live in host memory
