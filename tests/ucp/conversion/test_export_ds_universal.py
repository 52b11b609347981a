"""``ucp export --format ds-universal``: a checkpoint of a run under the runtime (``training.initialize``) goes
back to DeepSpeed. DeepSpeed 0.19.8 on the CPU loads the export with ``load_universal`` (in its own
processes: tools/peers/deepspeed_train.py under torchrun) and its next steps' losses are the UCP run's; the
export also converts back to the same UCP state (``ucp convert``), and a checkpoint of another structure is
refused naming what it lacks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import training
import ucp
from training.models import GPT, PRESETS, batch_for_step
from ucp.cli.main import app

SEED, LR, WD, SAVE_AT, STEPS = 1234, 1e-3, 0.01, 3, 5
CFG = PRESETS["tiny"]
# DeepSpeed's run in tools/peers/deepspeed_train.py: torch.optim.AdamW over one group (every parameter decayed)
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": WD}},
    "zero_optimization": {"stage": 2},
}


def train(engine: training.ModuleEngine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        tokens, targets = batch_for_step(step, 2, CFG.max_seq, CFG.vocab_size, SEED, rank=0, world_size=1)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """(the UCP checkpoint at step 3, the losses of steps 3 and 4 of the run that wrote it)."""
    root = tmp_path_factory.mktemp("ds_universal")
    engine = training.initialize(GPT(CFG, seed=SEED), config=DS_CONFIG)
    train(engine, range(SAVE_AT))
    engine.save(root / "ckpt")
    return root / "ckpt", train(engine, range(SAVE_AT, STEPS))


def test_deepspeed_resumes_the_export_with_load_universal(run: tuple[Path, list[float]], tmp_path: Path) -> None:
    from tools.peers import deepspeed_ckpt

    why = deepspeed_ckpt.deepspeed_missing()
    if why is not None:
        pytest.skip(why)
    ckpt, want = run
    out = tmp_path / "ds"
    result = CliRunner().invoke(app, ["export", str(ckpt), str(out), "--format", "ds-universal"])
    assert result.exit_code == 0, result.output
    assert (out / "latest_universal").read_text() == "global_step3"
    loss_file = tmp_path / "loss.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(deepspeed_ckpt.TRAIN_SCRIPT),
        *("--load-dir", str(out), "--zero-stage", "2", "--dtype", "fp32", "--steps", str(STEPS)),
        *("--model-json", CFG.model_dump_json(), "--seed", str(SEED), "--lr", repr(LR), "--weight-decay", repr(WD)),
        *("--micro-batch", "2", "--loss-file", str(loss_file)),
        *("--ds-config-extra", json.dumps({"checkpoint": {"load_universal": True}})),
    ]
    deepspeed_ckpt._run(cmd, timeout=300)
    record = json.loads(loss_file.read_text())
    assert record["start_step"] == SAVE_AT and record["end_step"] == STEPS
    got = [e["loss"] for e in sorted(record["losses"], key=lambda e: e["step"])]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-4, (got, want)

    # the bound means something: the same resume with Adam's moments zeroed misses step 4's loss by more
    zeroed = training.initialize(GPT(CFG, seed=SEED), config=DS_CONFIG)
    zeroed.load(ckpt)
    for t in (*zeroed.optimizer.exp_avg, *zeroed.optimizer.exp_avg_sq):
        t.zero_()
    other = train(zeroed, range(SAVE_AT, STEPS))
    assert abs(other[1] - want[1]) / abs(want[1]) > 1e-4, (other, want)


def test_export_converts_back_to_the_same_state(run: tuple[Path, list[float]], tmp_path: Path) -> None:
    """The universal folder is DeepSpeed's layout as UCP's own importer reads it: masters, moments, step, weights."""
    ckpt, _ = run
    report = ucp.export(ckpt, tmp_path / "ds", format="ds-universal", tag="resume")
    assert report.format == "ds-universal" and "resume/zero/embed.weight/exp_avg_sq.pt" in report.files
    ucp.convert(tmp_path / "ds", tmp_path / "back")
    back, saved = ucp.load(tmp_path / "back"), ucp.load(ckpt)
    for key in ("fp32_master", "exp_avg", "exp_avg_sq"):
        assert back["optimizer"][key].keys() == saved["optimizer"][key].keys()
        for name, value in saved["optimizer"][key].items():
            assert torch.equal(back["optimizer"][key][name], value), (key, name)
    assert back["optimizer"]["adam_step"] == saved["optimizer"]["adam_step"] == SAVE_AT
    assert back["step"] == SAVE_AT
    assert all(torch.equal(back["model"][n], v) for n, v in saved["model"].items())


def test_a_checkpoint_without_optimizer_state_is_refused(tmp_path: Path) -> None:
    ucp.save({"model": {"w": torch.ones(2)}}, tmp_path / "c")
    with pytest.raises(ucp.CheckpointError, match=r"not a training-engine checkpoint .*'optimizer.fp32_master'"):
        ucp.export(tmp_path / "c", tmp_path / "ds", format="ds-universal")
    assert not (tmp_path / "ds").exists()
    with pytest.raises(ucp.CheckpointError, match="no section or dtype"):
        ucp.export(tmp_path / "c", tmp_path / "ds", format="ds-universal", dtype="bf16")
