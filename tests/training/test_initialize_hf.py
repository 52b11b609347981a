"""``training.initialize`` with a Hugging Face GPT-2 (tiny config, random weights) as the client: it trains
like a plain ``torch.optim.AdamW`` loop, resumes at another world size and ZeRO stage with its Adam moments,
trains the same with the optimizer on NVMe, and its checkpoint exports to a model ``from_pretrained`` loads."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from module_engine_worker import ds_config, global_batch, gpt2, gpt2_config, train_steps
from training_helpers import run_world
from typer.testing import CliRunner

import training
from ucp.cli.main import app

WORKER = Path(__file__).parents[1] / "support" / "module_engine_worker.py"


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_zero0_matches_a_plain_adamw_loop(clip: float) -> None:
    """World 1, ZeRO-0, fp32: the engine's losses are a torch.optim.AdamW loop's, and fall. Bit for bit without
    clipping (kernels.adam is torch.optim's arithmetic); with it, within 1e-6 (the global norm is summed in
    float64 here, in float32 per tensor by clip_grad_norm_)."""
    model = gpt2()
    plain = copy.deepcopy(model)
    engine = training.initialize(model, config={**ds_config(0, micro=4, gas=1), "gradient_clipping": clip})
    got = train_steps(engine, range(6))

    opt = torch.optim.AdamW(plain.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    want = []
    for step in range(6):
        x = global_batch(step)
        loss = plain(input_ids=x, labels=x).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in got)
    assert got[4] < got[2] < got[0] and got[5] < got[3] < got[1]  # two alternating batches, each learnt
    if clip:
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-6, (got, want)
    else:
        assert got == want
    assert engine.global_steps == 6 and engine.get_lr() == [3e-3]


def test_gradient_accumulation_boundaries() -> None:
    engine = training.initialize(gpt2(), config=ds_config(1, micro=2, gas=2))
    assert engine.train_batch_size() == 4 and engine.is_gradient_accumulation_boundary() is False
    x = global_batch(0)[:2]
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    assert engine.global_steps == 0 and engine.is_gradient_accumulation_boundary()
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()


def test_fp16_loss_scale_from_the_config_survives_a_checkpoint(tmp_path: Path) -> None:
    """fp16: initial_scale_power / loss_scale_window drive the dynamic scale; save and load keep it."""
    fp16 = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 2}
    config = {**ds_config(2, micro=4, gas=1), "fp16": fp16}
    engine = training.initialize(gpt2(), config=config)
    assert engine.optimizer.scaler is not None and engine.optimizer.scaler.scale == 16.0
    losses = train_steps(engine, range(4))
    assert all(math.isfinite(v) for v in losses) and engine.was_step_applied()
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    assert engine.optimizer.scaler.scale == 64.0  # doubled after each 2 clean steps
    engine.save(tmp_path / "c", client_state={"epoch": 1})
    resumed = training.initialize(gpt2(seed=3), config=config)
    assert resumed.load(tmp_path / "c") == {"epoch": 1}
    assert resumed.optimizer.scaler is not None and resumed.optimizer.scaler.scale == 64.0
    assert resumed.global_steps == 4 and resumed.optimizer.adam_step == 4


def test_nvme_offload_from_a_deepspeed_config_trains_the_same(tmp_path: Path) -> None:
    """ZeRO-2 with offload_optimizer nvme (sub-groups small enough to pipeline) gives the in-memory losses."""
    swap = tmp_path / "nvme"
    swap.mkdir()
    zero = {
        "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "pin_memory": True, "buffer_count": 6},
        "sub_group_size": 20_000,
        "reduce_bucket_size": 5e7,  # a DeepSpeed internals key: logged as ignored
    }
    offloaded = training.initialize(gpt2(), config=ds_config(2, micro=2, gas=2, zero=zero, aio={"block_size": 1 << 20}))
    try:
        assert offloaded.optimizer.offload is not None and offloaded.optimizer.offload.describe()["subgroups"] > 1
        got = train_steps(offloaded, range(4))
    finally:
        offloaded.close()
    want = train_steps(training.initialize(gpt2(), config=ds_config(2, micro=2, gas=2)), range(4))
    assert got == want
    assert list(swap.iterdir()) == []


def test_offloaded_checkpoint_resumes_with_offload_switched(tmp_path: Path) -> None:
    """A checkpoint of an NVMe-offloaded engine resumes without offload, and one without resumes with it:
    the losses of the uninterrupted in-memory run, bit for bit."""
    swap = tmp_path / "nvme"
    swap.mkdir()
    nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}, "sub_group_size": 20_000}
    want = train_steps(training.initialize(gpt2(), config=ds_config(1, micro=4, gas=1)), range(5))
    for first, then in ((nvme, {}), ({}, nvme)):
        a = training.initialize(gpt2(), config=ds_config(1, micro=4, gas=1, zero=dict(first)))
        got = train_steps(a, range(2))
        a.save_checkpoint(tmp_path / "ckpt")
        a.close()
        b = training.initialize(gpt2(seed=5), config=ds_config(1, micro=4, gas=1, zero=dict(then)))
        try:
            assert b.load_checkpoint(tmp_path / "ckpt")[0] == str(tmp_path / "ckpt" / "global_step2")
            got += train_steps(b, range(2, 5))
        finally:
            b.close()
        assert got == want, (first, then)
    assert list(swap.iterdir()) == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"optimzer": {"type": "AdamW"}}, "optimzer: unknown key"),
        (
            {"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_sz": 1}},
            "zero_optimization.stage3_prefetch_bucket_sz: unknown key",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "beta": [0.9, 0.9]}}},
            "optimizer.params.beta: unknown key",
        ),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb'"),
        ({"bf16": {"enabled": True, "loss_scale": 1}}, "bf16.loss_scale: unknown key"),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler="),
        ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}, "train_batch_size 6"),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "nvme_path"),
    ],
)
def test_bad_config_names_the_key(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        training.initialize(gpt2(), config=config)


def test_config_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, **ds_config(3, micro=2, gas=1)}))
    engine = training.initialize(gpt2(), config=path)
    assert engine.zero_optimization_stage() == 3 and engine.config.dtype == "bf16"
    assert all(p.dtype == torch.bfloat16 for p in engine.optimizer.param_part)  # ZeRO-3: the partitions
    with torch.no_grad():  # an evaluation forward: ZeRO-3 lets its gathered weights go without a backward
        before = engine(input_ids=global_batch(0)).logits
    assert before.dtype == torch.bfloat16 and all(p.numel() == 0 for p in engine.module.parameters())
    assert all(math.isfinite(v) for v in train_steps(engine, range(2)))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "fp17": {}}))
    with pytest.raises(ValueError, match=f"DeepSpeed config {bad}: fp17: unknown key"):
        training.initialize(gpt2(), config=bad)


def test_checkpoint_at_two_ranks_resumes_at_one_and_exports_to_hf(tmp_path: Path) -> None:
    """ZeRO-3 at 2 ranks saves after 3 steps and goes on to 6; ZeRO-0 at 1 rank resumes from the checkpoint
    and continues that uninterrupted run's losses; the same resume with its Adam moments zeroed does not. ``ucp export --format hf``
    of the checkpoint loads with ``from_pretrained`` and gives the resumed model's logits, bit for bit."""
    ckpt = tmp_path / "ckpt"
    scenarios = [{"name": "full", "stage": 3, "micro": 2, "gas": 1, "steps": [0, 6], "save": str(ckpt), "save_at": 3}]
    run_world(2, scenarios, tmp_path / "world", timeout=240, worker=WORKER)
    full = json.loads((tmp_path / "world" / "full.json").read_text())
    assert (ckpt / "latest").read_text() == "global_step3"

    engine = training.initialize(gpt2(seed=7), config=ds_config(0, micro=2, gas=2))  # other weights: all replaced
    path, client = engine.load_checkpoint(ckpt)
    assert path == str(ckpt / "global_step3") and client == {"note": "hf", "step": 3}
    assert engine.global_steps == 3 and engine.optimizer.adam_step == 3
    x = global_batch(3)
    with torch.no_grad():
        logits = engine(input_ids=x).logits
    resumed = train_steps(engine, range(3, 6))
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, full[3:])) <= 1e-5, (resumed, full[3:])

    zeroed = training.initialize(gpt2(), config=ds_config(0, micro=2, gas=2))
    zeroed.load_checkpoint(ckpt)
    for t in (*zeroed.optimizer.exp_avg, *zeroed.optimizer.exp_avg_sq):
        t.zero_()
    other = train_steps(zeroed, range(3, 6))
    assert other[0] == resumed[0]  # step 3's loss comes before its update: the same weights
    assert min(abs(a - b) / abs(b) for a, b in zip(other[1:], full[4:])) > 1e-4, (other, full[3:])

    weights_only = training.initialize(gpt2(seed=7), config=ds_config(1, micro=2, gas=2))
    assert weights_only.load_checkpoint(tmp_path / "nowhere") == (None, None)  # DeepSpeed: a fresh run
    weights_only.load_checkpoint(ckpt, load_optimizer_states=False)
    assert weights_only.global_steps == 0 and weights_only.optimizer.adam_step == 0
    assert not any(t.any() for t in weights_only.optimizer.exp_avg)
    with torch.no_grad():
        assert torch.equal(weights_only(input_ids=x).logits, logits)

    out = tmp_path / "hf"
    result = CliRunner().invoke(app, ["export", str(ckpt / "global_step3"), str(out), "--format", "hf"])
    assert result.exit_code == 0, result.output
    gpt2_config().save_pretrained(out)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=x).logits, logits)
