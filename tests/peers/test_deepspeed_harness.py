"""The DeepSpeed peer harness produces real checkpoints that DeepSpeed's own tools can read.

Skipped when DeepSpeed is not installed. Checkpoints are cached under $UCP_PEER_CACHE
(default /tmp/ucp-peer-cache), so only the first run pays for training (~10-20 s per config).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Literal

import pytest
import torch

from tools.peers.deepspeed_ckpt import (  # noqa: E402
    PeerError,
    _run,
    deepspeed_missing,
    make_checkpoint,
    read_latest,
    reference_fp32,
    reference_universal,
)
from training.models import GPT, PRESETS, expected_param_shapes  # noqa: E402

needs_deepspeed = pytest.mark.skipif(deepspeed_missing() is not None, reason=str(deepspeed_missing()))

OPTIM_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _check_checkpoint(ckpt: Path, preset: str, world: int, stage: int, dtype: str, steps: int) -> None:
    cfg = PRESETS[preset]
    shapes = expected_param_shapes(cfg)
    tag = read_latest(ckpt)
    assert tag == f"global_step{steps}"
    prefix = "bf16_" if dtype == "bf16" else ""
    names = {p.name for p in (ckpt / tag).iterdir()}
    expected = {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)}
    if stage == 3:
        expected |= {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)}
    else:
        expected.add("mp_rank_00_model_states.pt")
    assert names == expected

    losses = json.loads((ckpt / "loss.json").read_text())["losses"]
    assert [r["step"] for r in losses] == list(range(steps))
    assert all(math.isfinite(r["loss"]) for r in losses)

    # zero_to_fp32: every parameter, right shape, fp32, and moved away from its initial value
    weights = reference_fp32(ckpt)
    assert {k: tuple(v.shape) for k, v in weights.items()} == shapes
    assert all(v.dtype == torch.float32 for v in weights.values())
    init = GPT(cfg, seed=1234).state_dict()  # the harness's default seed
    assert not torch.equal(weights["embed.weight"], init["embed.weight"])

    # ds_to_universal: fp32 + Adam moments for every parameter, equal to zero_to_fp32's weights.
    # ZeRO-1/2 files hold {"param": shaped tensor, "cat_dim": 0} plus a step.pt; ZeRO-3 files
    # hold the bare tensor flattened to 1-D and there is no step.pt.
    udir = reference_universal(ckpt)
    assert udir == ckpt / f"{tag}_universal"
    assert (ckpt / "latest_universal").read_text().strip() == udir.name
    assert {p.name for p in (udir / "zero").iterdir()} == {*shapes, "optimizer_state.pt"}
    for name, shape in shapes.items():
        pdir = udir / "zero" / name
        states = OPTIM_STATES if stage == 3 else (*OPTIM_STATES, "step")
        assert {p.name for p in pdir.iterdir()} == {f"{s}.pt" for s in states}, pdir
        for state in OPTIM_STATES:
            obj = torch.load(pdir / f"{state}.pt", weights_only=True)
            t = obj if stage == 3 else obj["param"]
            assert t.dtype == torch.float32, (name, state)
            assert tuple(t.shape) == ((math.prod(shape),) if stage == 3 else shape), (name, state)
            if state == "fp32":
                assert torch.equal(t.view(shape), weights[name]), name


@needs_deepspeed
def test_zero2_fp32_two_ranks() -> None:
    ckpt = make_checkpoint(world_size=2, zero_stage=2, dtype="fp32", steps=3, model_config="tiny")
    _check_checkpoint(ckpt, "tiny", world=2, stage=2, dtype="fp32", steps=3)
    # fp32 training: the model-states copy of the weights is the fp32 master copy itself
    module = torch.load(ckpt / "global_step3" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    weights = reference_fp32(ckpt)
    assert all(torch.equal(module[k], weights[k]) for k in weights)


@needs_deepspeed
@pytest.mark.full_matrix
@pytest.mark.parametrize(
    ("stage", "dtype", "world", "preset"),
    [
        (1, "bf16", 2, "tiny"),
        (3, "fp32", 2, "tiny"),
        (3, "bf16", 4, "tiny"),
        (3, "bf16", 2, "tiny-gqa"),
    ],
)
def test_other_stages(stage: int, dtype: Literal["fp32", "bf16"], world: int, preset: str) -> None:
    ckpt = make_checkpoint(world_size=world, zero_stage=stage, dtype=dtype, steps=3, model_config=preset)
    _check_checkpoint(ckpt, preset, world=world, stage=stage, dtype=dtype, steps=3)


@needs_deepspeed
@pytest.mark.full_matrix
def test_resume_matches_uninterrupted_run() -> None:
    """--load-dir continues the same data stream and optimizer state: same losses, same weights."""
    full = make_checkpoint(world_size=2, zero_stage=2, dtype="fp32", steps=5)
    first = make_checkpoint(world_size=2, zero_stage=2, dtype="fp32", steps=3)
    resumed = make_checkpoint(world_size=2, zero_stage=2, dtype="fp32", steps=5, load_dir=first)
    full_losses = json.loads((full / "loss.json").read_text())["losses"]
    resumed_losses = json.loads((resumed / "loss.json").read_text())["losses"]
    assert [r["step"] for r in resumed_losses] == [3, 4]
    assert resumed_losses == full_losses[3:]
    a, b = reference_fp32(full), reference_fp32(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_failed_training_reports_the_output(tmp_path: Path) -> None:
    # rejected by deepspeed_train.py's argument parser, before DeepSpeed is imported
    with pytest.raises(PeerError, match="unrecognized arguments: --no-such-flag"):
        make_checkpoint(tmp_path / "ckpt", extra_args=["--no-such-flag"], timeout=120)
    assert "--no-such-flag" in (tmp_path / "ckpt" / "train.log").read_text()


def test_timeout_kills_the_process_group(tmp_path: Path) -> None:
    marker = tmp_path / "child_alive"
    script = tmp_path / "parent.py"
    # the grandchild outlives its parent unless the whole process group is killed
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w').close()"
    script.write_text(
        f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(60)\n"
    )
    with pytest.raises(PeerError, match="timed out after 1 s"):
        _run([sys.executable, str(script)], timeout=1)
    time.sleep(4)
    assert not marker.exists()


def test_existing_checkpoint_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("global_step3")
    with pytest.raises(FileExistsError, match="already holds a DeepSpeed checkpoint"):
        make_checkpoint(tmp_path)
