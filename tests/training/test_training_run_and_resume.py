"""The training runtime's resume path, and ``python -m training.run``.

What a resume must give back: the same losses as an uninterrupted run (bit-exact in one process,
within the suite's 1e-5 across meshes), Adam's step count, the fp16 loss scale, the data position.
What it must refuse, with an error naming the cause rather than a silently wrong run: a checkpoint
of another model (tensors, or config fields with the same shapes), another data seed. A step that
raised leaves nothing behind (gradients, buckets, gathered ZeRO-3 weights), with or without a load;
every rank resumes from the same checkpoint even when a manager falls back on one rank only.
``python -m training.run`` rejects bad options with a usage error and fails when a checkpoint save
failed.

The two-rank cases run in real gloo processes of tests/support/training_run_and_resume_worker.py
(started by training_helpers.run_world).
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from repo_paths import SUPPORT
from training_helpers import GQA, PLAIN, rel_close, run_world
from training_run_and_resume_worker import ONE, engine, save_at

import ucp
from training import Engine
from training.models.gpt import GPTConfig

WORKER = SUPPORT / "training_run_and_resume_worker.py"


# -- single process: what resumes correctly ---------------------------------------------------------

FP16 = {"dtype": "fp16", "loss_scale": {"initial": 2.0**20, "growth_interval": 2}}


@pytest.mark.parametrize(
    "options",
    [
        {"zero_stage": 0},
        {"zero_stage": 3, "zero_alignment": 4, "grad_accum": 2, "micro_batch": 2},
        {"zero_stage": 2, **FP16},  # overflows skip steps: adam_step < step, the scale moves both ways
        {"zero_stage": 1, "dtype": "bf16", "clip": 0.05},  # every step clipped
    ],
    ids=["z0", "z3_accum", "z2_fp16_scaler", "z1_bf16_clip"],
)
def test_resume_is_bit_exact_in_one_process(tmp_path: Path, options: dict) -> None:
    """Save at step 3, resume in a fresh engine: losses, Adam's step, the loss scale and every state bit-exact."""
    ref = engine(**options)
    losses = [ref.train_step() for _ in range(6)]
    saved = engine(**options)
    manager = save_at(saved, tmp_path, 3)
    scalars = saved.optimizer.scalars()
    fresh = engine(**options)
    assert fresh.load(manager) == 3
    assert fresh.optimizer.scalars() == scalars
    if "fp16" in options.get("dtype", ""):
        assert scalars["adam_step"] < 3 < scalars["loss_scale"]["scale"]  # the run did skip steps
    assert [fresh.train_step() for _ in range(3, 6)] == losses[3:]
    assert fresh.optimizer.scalars() == ref.optimizer.scalars()
    for a, b in zip(fresh.checkpoint_targets().items(), ref.checkpoint_targets().items()):
        assert a[:2] == b[:2] and all(torch.equal(x.local, y.local) for x, y in zip(a[2], b[2])), a[:2]


def test_rollback_into_an_engine_that_trained_on(tmp_path: Path) -> None:
    """Loading an older checkpoint into a live ZeRO-3 engine replays the same steps bit for bit."""
    e = engine(zero_stage=3)
    manager = save_at(e, tmp_path, 2)
    first = [e.train_step() for _ in range(2, 5)]
    assert e.load(manager) == 2 and e.optimizer.adam_step == 2
    assert [e.train_step() for _ in range(2, 5)] == first


def test_learning_rate_schedule_resumes_at_the_saved_step(tmp_path: Path) -> None:
    """The schedule is a function of the step: the resumed engine asks it for steps 3.. again."""

    def schedule(step: int) -> float:
        return 1e-2 * (0.5**step)

    ref = Engine(GPTConfig(**GQA), lr_schedule=schedule, **ONE)
    losses = [ref.train_step() for _ in range(5)]
    manager = save_at(Engine(GPTConfig(**GQA), lr_schedule=schedule, **ONE), tmp_path, 3)
    fresh = Engine(GPTConfig(**GQA), lr_schedule=schedule, **ONE)
    assert fresh.load(manager) == 3
    assert [fresh.train_step() for _ in range(3, 5)] == losses[3:]


@pytest.mark.parametrize(
    "change,tensor",
    [({"d_ff": 64}, "layers.0.mlp.fc1.weight"), ({"vocab_size": 100}, "embed.weight"), ({"n_layer": 3}, "layers.2.")],
)
def test_shape_mismatch_names_the_tensor(tmp_path: Path, change: dict, tensor: str) -> None:
    manager = save_at(engine(), tmp_path, 1)
    other = engine({**GQA, **change})
    with pytest.raises(ucp.CheckpointError, match=tensor.replace(".", r"\.")):
        other.load(manager)
    with pytest.raises(ucp.CheckpointError, match=tensor.replace(".", r"\.")):
        other.load(manager.path(1))  # a directory: no manager fallback in between


def test_weights_only_checkpoint_is_refused_clearly(tmp_path: Path) -> None:
    from training.models.gpt import GPT

    ucp.save({"model": GPT(GPTConfig(**GQA)).state_dict()}, tmp_path / "w")
    with pytest.raises(ucp.CheckpointError, match="step"):
        engine().load(tmp_path / "w")


# -- single process: what a resume refuses -----------------------------------------------------------


@pytest.mark.parametrize(
    "change,named",
    [
        ({"n_layer": 1}, [r"n_layer 2 vs 1", r"this model lacks: model\.layers\.1\."]),
        ({"n_head": 8, "n_kv_head": 8}, [r"n_head 4 vs 8", r"n_kv_head 4 vs 8"]),
    ],
    ids=["fewer_layers", "n_head"],
)
def test_checkpoint_of_another_model_config_is_refused(tmp_path: Path, change: dict, named: list[str]) -> None:
    """The recorded model config and the model tensor names must be this engine's; the error names the differences."""
    plain = {**PLAIN, "d_ff": 48, "n_head": 4}
    manager = save_at(engine(plain), tmp_path, 1)
    other = engine({**plain, **change})  # n_head 8: every tensor has the same shape as with 4 heads
    before = [x.local.clone() for _, _, pieces in other.checkpoint_targets().items() for x in pieces]
    for source in (manager.path(1), manager):
        with pytest.raises(ucp.CheckpointError) as exc:
            other.load(source)
        for pattern in named:
            assert re.search(pattern, str(exc.value)), str(exc.value)
    after = [x.local for _, _, pieces in other.checkpoint_targets().items() for x in pieces]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # refused before overwriting anything


def test_an_equal_model_config_written_differently_is_accepted(tmp_path: Path) -> None:
    """n_kv_head None means n_head, and init_std only shapes the initial weights: neither is a difference."""
    plain = {**PLAIN, "d_ff": 48}
    manager = save_at(engine(plain), tmp_path, 1)
    assert engine({**plain, "n_kv_head": plain["n_head"], "init_std": 0.5}).load(manager) == 1


def test_resume_with_another_data_seed_is_refused(tmp_path: Path) -> None:
    manager = save_at(engine(data_seed=0), tmp_path, 2)
    assert ucp.load(manager.path(2))["rng"] == {"seed": 0, "data_seed": 0}
    with pytest.raises(ucp.CheckpointError, match="data_seed 0.*data_seed 1"):
        engine(data_seed=1).load(manager)
    assert engine(data_seed=0).load(manager) == 2


class Boom(RuntimeError):
    pass


def abort_a_step(e: Engine) -> None:
    """A train_step that fails in the second micro-batch's forward (an OOM, a NaN guard, ^C...)."""
    calls = {"n": 0}

    def hook(module: torch.nn.Module, args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise Boom("injected failure in forward")

    handle = e.model.ln_f.register_forward_pre_hook(hook)
    try:
        with pytest.raises(Boom):
            e.train_step()
    finally:
        handle.remove()


# -- single process: a step that raised --------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_load_after_an_aborted_step_resumes_cleanly(tmp_path: Path, stage: int) -> None:
    """Gradients of the aborted step's first micro-batch, stage-2 buckets and ZeRO-3 gathered weights are gone."""
    e = engine(zero_stage=stage, grad_accum=2, micro_batch=2)
    manager = save_at(e, tmp_path, 2)
    expected = [e.train_step() for _ in range(2, 4)]
    abort_a_step(e)
    assert e.load(manager) == 2
    assert [e.train_step() for _ in range(2, 4)] == expected


@pytest.mark.parametrize("stage", [2, 3])
def test_a_step_that_raised_can_simply_be_retried(stage: int) -> None:
    """Without a load: the retried step is the step an uninterrupted run takes."""
    options = {"zero_stage": stage, "grad_accum": 2, "micro_batch": 2}
    ref = engine(**options)
    expected = [ref.train_step() for _ in range(3)]
    e = engine(**options)
    e.train_step()
    abort_a_step(e)
    assert e.step == 1 and e.optimizer._micro == 0
    assert [e.train_step() for _ in range(1, 3)] == expected[1:]


# -- python -m training.run ---------------------------------------------------------------------------

RUN = ["--model", "tiny", "--steps", "2", "--micro-batch", "1", "--seq-len", "8"]


def run_main(argv: list[str]) -> int:
    from training import run

    return run.main([*RUN, *argv])


def test_run_rejects_a_bad_zero_stage() -> None:
    with pytest.raises(SystemExit) as exc:
        run_main(["--zero", "5"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--tp", "0"],
        ["--pp", "0"],
        ["--save-every", "0", "--save-dir", "{tmp}"],
        ["--model", "no-such-model"],
        ["--steps", "-1"],
        ["--start-step", "-1"],
        ["--tp", "2"],
        ["--dp", "2"],
        ["--resume"],
        ["--resume", "--save-dir", "{tmp}", "--start-step", "3"],
    ],
    ids=[
        "tp0",
        "pp0",
        "save_every0",
        "unknown_model",
        "negative_steps",
        "negative_start",
        "world_not_a_multiple_of_tp",
        "mesh_not_the_world",
        "resume_without_dir",
        "start_step_with_resume",
    ],
)
def test_run_rejects_bad_arguments_with_a_usage_error(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path / "ck")) for a in argv]
    with pytest.raises(SystemExit) as exc:
        run_main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()  # refused before training anything


def test_run_fails_when_an_async_save_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import ucp.saving.background.execute as bg

    original = bg.write_image

    def disk_full(storage: Any, rel: str, *args: Any) -> Any:
        if "step-00000002" in rel:  # the last checkpoint of the run
            raise OSError(errno.ENOSPC, "No space left on device (injected)", rel)
        return original(storage, rel, *args)

    monkeypatch.setattr(bg, "write_image", disk_full)
    root = tmp_path / "ck"
    code = run_main(["--save-dir", str(root), "--snapshot", "sync"])
    out, err = capsys.readouterr()
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["checkpoint"] for x in lines if "checkpoint" in x] == [1, 2]  # step 2's save started, then failed
    assert ucp.CheckpointManager(root).latest() == 1  # step 2 was never written
    assert code == 1 and "No space left on device (injected)" in err
    assert not any(x.get("done") for x in lines)


# -- two ranks ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of two gloo ranks: the corrupt-checkpoint resume and the pp 2 save/resume."""
    base = tmp_path_factory.mktemp("edges")
    reference = engine(zero_stage=0)
    losses = [reference.train_step() for _ in range(6)]
    save_at(engine(zero_stage=2), base / "dp1", 3)
    scenarios = [
        {"name": "corrupt", "action": "corrupt", "root": str(base / "corrupt")},
        {"name": "pp2", "action": "pp2", "root": str(base / "pp2"), "from_dp1": str(base / "dp1")},
    ]
    run_world(2, scenarios, base / "out", timeout=90, worker=WORKER)
    results = {
        sc["name"]: [json.loads((base / "out" / f"{sc['name']}.rank{r}.json").read_text()) for r in range(2)]
        for sc in scenarios
    }
    return {"reference": losses, "results": results, "pp2_root": base / "pp2"}


def test_pipeline_checkpoint_resumes_on_any_mesh(two_ranks: dict[str, Any]) -> None:
    """pp 2 (tied embedding saved by the first stage) -> one process, and one process -> pp 2."""
    ref = two_ranks["reference"]
    pp2 = two_ranks["results"]["pp2"][0]
    assert rel_close(pp2["losses"], ref, 1e-5), pp2["losses"]
    assert pp2["start"] == 3 and pp2["adam_step"] == 6 and rel_close(pp2["resumed"], ref[3:], 1e-5)
    e = engine(zero_stage=3)
    assert e.load(ucp.CheckpointManager(two_ranks["pp2_root"])) == 3 and e.optimizer.adam_step == 3
    assert rel_close([e.train_step() for _ in range(3, 6)], ref[3:], 1e-5)


def test_every_rank_resumes_from_the_same_checkpoint(two_ranks: dict[str, Any]) -> None:
    """A piece only rank 1 reads is corrupt in step 2: its manager falls back to step 1, so both ranks take step 1."""
    ranks = two_ranks["results"]["corrupt"]
    assert ranks[0] == ranks[1] == {"start": 1, "adam_step": 1, "loaded_step": 1}, ranks
