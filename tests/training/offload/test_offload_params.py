"""Parameters on NVMe at ZeRO-3 (``offload_param: {device: nvme}``, training.offload.params): the partitions live
in swap files read through aio, ahead of the modules that need them, and training gives the in-memory run's
losses and weights bit for bit (fp32, same kernel) with the optimizer on NVMe too, at 1 and 2 ranks, through
``training.Engine`` and ``training.initialize``; a partition larger than one buffer is split across buffers;
checkpoints move between param offload on and off; a bad or changed swap tier is an error naming the file and
the parameter's partition."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from module_engine_worker import ds_config, gpt2, train_steps
from offload_helpers import gpt_engine, scribble, tmpfs, train_saving_at
from offload_worker import weights_digest
from training_helpers import run_world

import training
import ucp
from training import Engine, run
from training.offload import OffloadConfig, OffloadError
from training.zero import ZeroOptimizer

WORKER = Path(__file__).resolve().parents[2] / "support" / "offload_worker.py"
MODEL = {"vocab_size": 512, "n_layer": 2, "n_head": 4, "d_model": 64, "d_ff": 256, "max_seq": 32}
OPTIONS: dict[str, Any] = {"micro_batch": 2, "weight_decay": 0.1, "clip": 1.0, "lr": 3e-3, "zero_stage": 3}
BUFFER = 4096  # elements per buffer: an embedding's partition (32,768 elements) is cut into 8 chunks
SPLIT, STEPS = 2, 3


def nvme(path: Path, optimizer: bool = True, **param: Any) -> dict[str, Any]:
    section = {"device": "nvme", "nvme_path": str(path), "buffer_size": BUFFER, "buffer_count": 4, **param}
    out: dict[str, Any] = {"offload_param": section, "sub_group_size": 65536}
    if optimizer:
        out["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path)}
    return out


def engine(off: dict[str, Any] | None, **options: Any) -> Engine:
    return gpt_engine(MODEL, OPTIONS, off, **options)


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], str, Path]:
    """The in-memory ZeRO-3 run: its losses, weights after STEPS, and its checkpoint after SPLIT steps."""
    root = tmp_path_factory.mktemp("memory")
    e = engine(None)
    losses, ckpt = train_saving_at(e, root, STEPS, SPLIT)
    digest = weights_digest(e)
    e.close()
    return losses, digest, ckpt


def test_params_and_optimizer_on_nvme_train_bit_equal_to_in_memory(
    tmp_path: Path, in_memory: tuple[list[float], str, Path]
) -> None:
    ref, ref_digest, mem_ckpt = in_memory
    root = tmp_path / "ckpt"
    e = engine(nvme(tmp_path))
    tier = e.optimizer.param_tier
    assert tier is not None
    off = tier.offload
    try:
        losses = []
        for s in range(STEPS):
            losses.append(e.train_step(s))
            if s + 1 == SPLIT:
                e.save(ucp.CheckpointManager(root))
        shape = off.describe()
        assert all(t.numel() == 0 for t in e.optimizer.param_part)  # no partition stays in memory
        largest = max(p.numel for p in off.partitions)
        assert largest > BUFFER and off.chunks(next(p.index for p in off.partitions if p.numel == largest)) > 1
        files = sorted(Path(shape["dir"]).glob("param-*.swp"))
        assert len(files) == shape["swapped"] > 0 and all(f.stat().st_size % shape["alignment"] == 0 for f in files)
        assert shape["pool_peak"] <= shape["budget"] == 4 * BUFFER * 4  # the pool never held more than its budget
        st = off.stats()
        assert st["bytes_read"] >= STEPS * 2 * sum(f.stat().st_size for f in files)  # forward and backward, each step
        assert st["hits"] > 0 and st["io_read"] > 0  # some partitions were read ahead in the recorded order
        digest = weights_digest(e)
    finally:
        e.close()
    assert not Path(shape["dir"]).exists()
    assert (losses, digest) == (ref, ref_digest)
    # the checkpoint's weights and state are the in-memory run's, bit for bit
    path = ucp.CheckpointManager(root).path(SPLIT)
    ours, theirs = ucp.load(path), ucp.load(mem_ckpt)
    for section in ("model", "optimizer"):
        assert _flat(ours[section]).keys() == _flat(theirs[section]).keys()
        for k, v in _flat(ours[section]).items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, _flat(theirs[section])[k]), k


def test_checkpoints_move_between_param_offload_on_and_off(
    tmp_path: Path, in_memory: tuple[list[float], str, Path]
) -> None:
    ref, _, mem_ckpt = in_memory
    on = engine(nvme(tmp_path, optimizer=False))
    try:  # saved with it off, resumed with it on
        assert on.load(mem_ckpt) == SPLIT
        assert [on.train_step(s) for s in range(SPLIT, STEPS)] == ref[SPLIT:]
        root = tmp_path / "ckpt"
        on.save(ucp.CheckpointManager(root))  # after STEPS
        after = weights_digest(on)
        going_on = on.train_step(STEPS)
    finally:
        on.close()
    off = engine(None)  # saved with it on, resumed with it off
    try:
        assert off.load(ucp.CheckpointManager(root)) == STEPS
        assert weights_digest(off) == after
        assert off.train_step(STEPS) == going_on  # the moments came back too
    finally:
        off.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_two_ranks_params_on_nvme_match_in_memory(tmp_path: Path) -> None:
    swap = tmp_path / "nvme"
    swap.mkdir()
    base = {"model": MODEL, "mesh": {"dp": 2}, "options": OPTIONS, "steps": 2}
    scenarios = [{**base, "name": "z3", "offload": None}, {**base, "name": "z3_params", "offload": nvme(swap)}]
    run_world(2, scenarios, tmp_path, timeout=300, worker=WORKER)
    for rank in (0, 1):
        ref, got = (json.loads((tmp_path / f"{n}.rank{rank}.json").read_text()) for n in ("z3", "z3_params"))
        assert (got["losses"], got["digest"]) == (ref["losses"], ref["digest"]), rank
        params = got["params"]
        assert params["largest_partition"] > BUFFER and params["swapped"] > 0
        assert params["bytes_read"] > 0 and params["hits"] > 0 and params["pool_peak"] <= params["budget"]
    assert list(swap.iterdir()) == []  # every rank's swap directories are gone


def test_initialize_a_hugging_face_model_with_params_on_nvme(tmp_path: Path) -> None:
    """training.initialize(model, config=ds_config): the same losses and weights as in memory; its checkpoint
    resumes with param offload off, and on."""
    zero = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_size": 1024, "buffer_count": 3}}
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    plain = training.initialize(gpt2(), config=ds_config(3, micro=4, gas=1))
    offloaded = training.initialize(gpt2(), config=ds_config(3, micro=4, gas=1, zero=zero))
    tier = offloaded.optimizer.param_tier
    assert tier is not None
    try:
        want, got = train_steps(plain, range(2)), train_steps(offloaded, range(2))
        assert got == want
        assert tier.offload.describe()["swapped"] > 0 and max(p.numel for p in tier.offload.partitions) > 1024
        for a, b in zip(tier.stage(), plain.optimizer.param_part):
            assert torch.equal(a, b)
        offloaded.save(tmp_path / "ckpt")
    finally:
        offloaded.close()
    resumed = training.initialize(gpt2(seed=1), config=ds_config(3, micro=4, gas=1))
    resumed.load(tmp_path / "ckpt")
    want = train_steps(plain, range(2, 3))
    assert train_steps(resumed, range(2, 3)) == want
    again = training.initialize(gpt2(seed=1), config=ds_config(3, micro=4, gas=1, zero=zero))  # and with it on
    try:
        again.load(tmp_path / "ckpt")  # the weights streamed into the parameter tier from the loaded masters
        assert train_steps(again, range(2, 3)) == want
    finally:
        again.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_params_on_nvme_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--steps", "2", "--model", "tiny", "--micro-batch", "2", "--seq-len", "32", "--zero", "3"]

    def losses(argv: list[str]) -> list[float]:
        assert run.main(argv) == 0
        out = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
        return [x["loss"] for x in out if "step" in x]

    assert losses([*args, "--offload-param", "nvme", "--nvme-path", str(tmp_path)]) == losses(args)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as info:
        run.parse_args([*args[:-1], "1", "--offload-param", "nvme", "--nvme-path", str(tmp_path)], world=1)
    assert info.value.code == 2 and "offload_param.device 'nvme' needs --zero 3 (it is 1)" in capsys.readouterr().err


# -- bad input ---------------------------------------------------------------------------------------------------


def test_missing_or_read_only_nvme_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(OffloadError, match=rf"offload_param.nvme_path '{missing}' does not exist"):
        engine(nvme(missing, optimizer=False))
    with tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        with pytest.raises(OffloadError, match=rf"offload_param.nvme_path '{ro}': cannot create the run's swap dir"):
            engine(nvme(ro, optimizer=False))


def test_params_on_nvme_are_refused_off_zero_3_and_off_a_cpu_engine(tmp_path: Path) -> None:
    config = OffloadConfig.model_validate(nvme(tmp_path, optimizer=False))
    with pytest.raises(ValueError, match=r"offload_param.device 'nvme' needs ZeRO stage 3 \(the stage is 2\)"):
        ZeroOptimizer.for_module(torch.nn.Linear(64, 64), stage=2, offload=config)
    with pytest.raises(ValueError, match=r"offload_param.device 'nvme' is not supported yet on meta"):
        ZeroOptimizer.for_module(torch.nn.Linear(64, 64, device="meta"), stage=3, offload=config)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_swap_file_changed_under_the_run_names_file_and_partition(tmp_path: Path, damage: str) -> None:
    e = engine(nvme(tmp_path, optimizer=False))
    try:
        e.train_step(0)
        assert e.optimizer.param_tier is not None
        off = e.optimizer.param_tier.offload
        k = max(off.partitions, key=lambda p: p.numel).index  # the embedding: several chunks
        victim, name = off.path(k), off.partitions[k].name
        if damage == "truncated":
            os.truncate(victim, victim.stat().st_size // 2)
        else:
            scribble(victim, 3 * BUFFER * 4 + 100)  # inside the fourth chunk
        what = "is truncated" if damage == "truncated" else r"is corrupt: bytes \[49152, 65536\) have CRC-32C"
        with pytest.raises(
            OffloadError, match=rf"swap file {victim} of parameter '{name}' \(partition 0 of 1: .*\) {what}"
        ):
            e.train_step(1)
        assert off.pool.lent == 0  # every buffer back in the pool, none given back twice
    finally:
        e.close()
    assert list(tmp_path.iterdir()) == []


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
    return out
