"""DeepSpeedConfig: a whole DeepSpeed config read with DeepSpeed's meanings (batch sizes, Adam's adam_w_mode,
precision, clipping, ZeRO and offload through OffloadConfig, decoupled checkpoints), ignored keys logged; and a
ModuleEngine checkpoint carries a module's persistent buffers."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import training
from training.ds_config import DeepSpeedConfig


@pytest.mark.parametrize(
    ("keys", "world", "want"),
    [
        ({"train_batch_size": 16}, 2, (8, 1, 16)),
        ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, 2, (2, 4, 16)),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (2, 4, 16)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4, (3, 2, 24)),
        (
            {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
            2,
            (3, 2, 12),
        ),
    ],
)
def test_batch_sizes_derive_as_in_deepspeed(keys: dict, world: int, want: tuple[int, int, int]) -> None:
    cfg = DeepSpeedConfig.from_deepspeed(keys, world_size=world)
    assert (cfg.micro_batch, cfg.grad_accum, cfg.train_batch_size) == want


def test_inconsistent_batch_sizes_name_them() -> None:
    with pytest.raises(
        ValueError, match=r"train_batch_size 12 != train_micro_batch_size_per_gpu 3 × gradient_accumulation"
    ):
        DeepSpeedConfig.from_deepspeed(
            {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 2
        )
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0: a positive integer"):
        DeepSpeedConfig.from_deepspeed({"gradient_accumulation_steps": 0})


def test_optimizer_precision_clipping_and_zero() -> None:
    cfg = DeepSpeedConfig.from_deepspeed(
        {
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 2e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01},
            },
            "bf16": {"enabled": True},
            "gradient_clipping": 0.5,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        }
    )
    a = cfg.adam
    assert (a.lr, a.beta1, a.beta2, a.eps, a.weight_decay) == (2e-4, 0.8, 0.99, 1e-6, 0.01)
    assert a.decoupled  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    assert (cfg.dtype, cfg.clip, cfg.zero_stage, cfg.offload.offload_optimizer.device) == ("bf16", 0.5, 3, "cpu")
    plain = DeepSpeedConfig.from_deepspeed({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert not plain.adam.decoupled and plain.zero_stage == 0 and plain.clip is None and plain.dtype == "fp32"
    assert DeepSpeedConfig.from_deepspeed({"gradient_clipping": 0}).clip is None
    with pytest.raises(ValueError, match="bf16 and fp16 are both enabled"):
        DeepSpeedConfig.from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ValueError, match="optimizer.params.adam_w_mode: unknown key for AdamW"):
        DeepSpeedConfig.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    with pytest.raises(ValueError, match="optimizer.params.amsgrad=True is not supported"):
        DeepSpeedConfig.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}})
    with pytest.raises(ValueError, match="fp16.loss_scale=128: only 0"):
        DeepSpeedConfig.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}})
    with pytest.raises(ValueError, match="prescale_gradients=True is not supported"):
        DeepSpeedConfig.from_deepspeed({"prescale_gradients": True})
    with pytest.raises(ValueError, match="scheduler=.* is not supported .*: pass lr_scheduler= to training.initialize"):
        DeepSpeedConfig.from_deepspeed({"scheduler": {"type": "WarmupLR"}})
    assert DeepSpeedConfig.from_deepspeed({"scheduler": None, "amp": {"enabled": False}}).dtype == "fp32"


def test_ignored_keys_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        DeepSpeedConfig.from_deepspeed(
            {
                "steps_per_print": 5,
                "wall_clock_breakdown": False,
                "zero_optimization": {"stage": 1, "overlap_comm": True},
            }
        )
    text = caplog.text
    assert "steps_per_print=5 ignored: DeepSpeed's own progress logging" in text
    assert "wall_clock_breakdown=False ignored" in text
    assert "zero_optimization.overlap_comm=True ignored" in text


def test_checkpoint_section_reads_writer_decoupled(caplog: pytest.LogCaptureFixture) -> None:
    """``checkpoint.writer.decoupled`` turns decoupled saves on; the keys that tune DeepSpeed's own writer are
    logged as ignored; a key that would change where DeepSpeed writes is refused, an unknown one is an error."""
    assert DeepSpeedConfig.from_deepspeed({}).decoupled_save is False
    assert DeepSpeedConfig.from_deepspeed({"checkpoint": {"writer": None}}).decoupled_save is False
    assert DeepSpeedConfig.from_deepspeed({"checkpoint": None}).decoupled_save is False  # DeepSpeed's defaults
    with caplog.at_level(logging.INFO):
        cfg = DeepSpeedConfig.from_deepspeed(
            {
                "checkpoint": {
                    "tag_validation": "Fail",
                    "load_universal": False,
                    "use_node_local_storage": False,
                    "writer": {"type": "fast", "decoupled": True, "io_buffer_size": 1e8, "data_parallel": "socket"},
                }
            }
        )
    assert cfg.decoupled_save is True
    assert "checkpoint.writer.type='fast' ignored: it tunes DeepSpeed's own checkpoint writer" in caplog.text
    assert "checkpoint.writer.io_buffer_size=100000000.0 ignored" in caplog.text
    assert "checkpoint.tag_validation='Fail' ignored: the ranks' tags are always compared" in caplog.text
    bad = [
        ({"writer": {"decoupled": "yes"}}, "checkpoint.writer.decoupled='yes': true or false"),
        ({"writer": {"decoupld": True}}, "checkpoint.writer.decoupld: unknown key"),
        (
            {"use_node_local_storage": True},
            "checkpoint.use_node_local_storage=True is not supported (only DeepSpeed's default False is accepted: "
            "the ranks save into one shared directory)",
        ),
        ({"tag_validaton": "Warn"}, "checkpoint.tag_validaton: unknown key"),
        ([], "checkpoint must be a JSON object"),
    ]
    for section, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            DeepSpeedConfig.from_deepspeed({"checkpoint": section})


def test_model_parameters_must_be_the_models_own() -> None:
    model = nn.Linear(3, 2)
    training.initialize(model, config={}, model_parameters=model.parameters())
    with pytest.raises(ValueError, match="model_parameters: 1 tensors given, the model has 2"):
        training.initialize(nn.Linear(3, 2), config={}, model_parameters=[model.weight])
    with pytest.raises(ValueError, match="parameter groups"):
        training.initialize(nn.Linear(3, 2), config={}, model_parameters=[{"params": [model.weight]}])


def test_persistent_buffers_are_checkpointed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    engine = training.initialize(net, config={"zero_optimization": {"stage": 2}})
    for _ in range(3):
        loss = engine(torch.randn(6, 4)).square().mean()
        engine.backward(loss)
        engine.step()
    engine.save(tmp_path / "c")
    fresh = training.initialize(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)), config={})
    fresh.load(tmp_path / "c")
    got, want = fresh.module[1].state_dict(), net[1].state_dict()
    assert int(got["num_batches_tracked"]) == 3
    assert all(torch.equal(got[k], want[k]) for k in ("running_mean", "running_var"))
    assert all(torch.equal(a, b) for a, b in zip(fresh.module.parameters(), net.parameters()))
