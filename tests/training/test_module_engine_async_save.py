"""Decoupled checkpoints of ``training.initialize``'s engine (DeepSpeed's ``checkpoint.writer.decoupled``):
``save_checkpoint`` returns once the state is snapshotted and training goes on while it is written. With the
optimizer and the parameters on NVMe (ZeRO-3) the save streams copies of the swap files; in memory (ZeRO-2) a
writer process writes it. Either way the checkpoint is the synchronous save's of the same step, bit for bit, it
resumes the uninterrupted run's losses, ``latest`` names the tag only once it is committed, and a save that fails
raises at the next wait point naming the checkpoint, leaving the previous one loadable."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from module_engine_worker import corrupting, ds_config, gpt2, train_steps
from training_helpers import run_world

import training
import ucp
from training import saving
from training.offload import OffloadError
from training.offload import checkpoint as offload_checkpoint
from ucp.saving.background import execute as execute_mod

WORKER = Path(__file__).parents[1] / "support" / "module_engine_worker.py"
DECOUPLED = {"writer": {"decoupled": True, "type": "fast", "io_buffer_size": 1 << 20}}


def nvme(path: Path, params: bool = True) -> dict[str, Any]:
    path.mkdir(parents=True, exist_ok=True)
    zero: dict[str, Any] = {"offload_optimizer": {"device": "nvme", "nvme_path": str(path)}, "sub_group_size": 20_000}
    if params:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(path), "buffer_size": 4096, "buffer_count": 4}
    return zero


def engine(stage: int, zero: dict[str, Any], decoupled: bool, **kw: Any) -> training.ModuleEngine:
    extra = {"checkpoint": DECOUPLED} if decoupled else {}
    return training.initialize(gpt2(), config=ds_config(stage, micro=4, gas=1, zero=zero, **extra), **kw)


def assert_same_state(a: Any, b: Any, where: str = "") -> None:
    """Two loaded checkpoints' states: the same keys, every tensor bit-equal, every plain value equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def latest(root: Path) -> str:
    return (root / "latest").read_text()


@pytest.fixture
def held_commit(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The writer thread's commits wait until the returned event is set (the data file is written before)."""
    gate = threading.Event()
    real = execute_mod.committer

    class Held:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def commit(self, report: Any) -> Any:
            assert gate.wait(120), "the commit was never let go"
            return self.inner.commit(report)

    monkeypatch.setattr(execute_mod, "committer", lambda storage, job: Held(real(storage, job)))
    gate.set()
    return gate


class GatedCopies(list[Any]):
    """The copies of the swap files that saves make (TierCopy, ParamCopy): each is made only once its ``wait()``
    is called (what the engine calls before it may rewrite the tiers), so a step that did not wait would find it
    not made."""

    def release(self) -> None:
        """Let every copy be made (before closing an engine whose check failed, so nothing waits on a gate)."""
        for copy in self:
            copy.gate.set()


@pytest.fixture
def gated_copies(monkeypatch: pytest.MonkeyPatch) -> GatedCopies:
    made = GatedCopies()

    def gated(base: type) -> type:
        class Gated(base):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.gate = threading.Event()  # before the copy starts, on its own thread
                super().__init__(*args, **kwargs)
                made.append(self)

            def _copy(self) -> None:
                assert self.gate.wait(60), "nothing waited for this copy"
                super()._copy()

            def wait(self) -> None:
                self.gate.set()
                super().wait()

        return Gated

    for name in ("TierCopy", "ParamCopy"):
        monkeypatch.setattr(saving, name, gated(getattr(saving, name)))
    return made


def steps_after_copies(e: training.ModuleEngine, copies: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every optimizer step of ``e`` checks that the swap files' copies made so far are done (they are read by
    the save while the step rewrites the originals)."""
    step = e.optimizer.step

    def checked(*args: Any, **kwargs: Any) -> Any:
        assert all(c.copied.done() for c in copies), "an optimizer step began before a save's copy was made"
        return step(*args, **kwargs)

    monkeypatch.setattr(e.optimizer, "step", checked)


def copies_left(swap: Path) -> list[str]:
    """The checkpoint copies (TierCopy's, ParamCopy's ``checkpoint-*`` directories) still in swap directory ``swap``."""
    return sorted(p.name for p in swap.rglob("checkpoint-*"))


def test_nvme_zero3_decoupled_save_is_the_sync_save_and_names_latest_once_committed(
    tmp_path: Path, held_commit: threading.Event, gated_copies: GatedCopies, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync_root, root, swap = tmp_path / "sync", tmp_path / "decoupled", tmp_path / "b"
    ref = engine(3, nvme(tmp_path / "a"), decoupled=False)
    try:
        want = train_steps(ref, range(2))
        ref.save_checkpoint(sync_root)
        want += train_steps(ref, range(2, 4))
    finally:
        ref.close()

    e = engine(3, nvme(swap), decoupled=True)
    steps_after_copies(e, gated_copies, monkeypatch)
    try:
        assert e.optimizer.param_tier is not None and e.optimizer.offload is not None
        got = train_steps(e, range(1))
        assert e.save_checkpoint(root) is True
        assert len(gated_copies) == 2 and copies_left(swap)  # both tiers' swap files, copied once the step waits
        got += train_steps(e, range(1, 2))
        e.wait_checkpoints()
        assert latest(root) == "global_step1" and copies_left(swap) == []  # removed once the save is reported
        held_commit.clear()
        e.save_checkpoint(root)  # returns with the commit held: the tag is not committed, latest not moved
        assert latest(root) == "global_step1" and not (root / "global_step2").exists()
        got += train_steps(e, range(2, 4))  # the optimizer steps rewrite both tiers under the save
        assert latest(root) == "global_step1" and len(copies_left(swap)) == 2
        held_commit.set()
        e.wait_checkpoints()
        assert latest(root) == "global_step2" and copies_left(swap) == []
        assert len(gated_copies) == 4
    finally:
        held_commit.set()
        gated_copies.release()
        e.close()
    assert got == want  # the save did not disturb training
    assert_same_state(ucp.load(root / "global_step2"), ucp.load(sync_root / "global_step2"))
    assert [p.name for p in (tmp_path / "b").iterdir()] == []  # the swap directory and its copies are gone

    resumed = engine(3, nvme(tmp_path / "c"), decoupled=True)
    try:
        assert resumed.load_checkpoint(root)[0] == str(root / "global_step2")
        assert train_steps(resumed, range(2, 4)) == want[2:]
    finally:
        resumed.close()


def test_in_memory_zero2_decoupled_save_through_a_writer_process(tmp_path: Path) -> None:
    sync_root, root = tmp_path / "sync", tmp_path / "decoupled"
    ref = engine(2, {}, decoupled=False)
    try:
        want = train_steps(ref, range(2))
        ref.save_checkpoint(sync_root, client_state={"epoch": 1})
        want += train_steps(ref, range(2, 4))
    finally:
        ref.close()

    saver = ucp.AsyncSaver(mode="process")
    try:
        e = engine(2, {}, decoupled=True, saver=saver)
        try:
            got = train_steps(e, range(2))
            e.save_checkpoint(root, client_state={"epoch": 1})
            got += train_steps(e, range(2, 4))
        finally:
            e.close()  # waits for the save in flight; the saver is the caller's
        assert saver.writer_pid is not None
        assert latest(root) == "global_step2" and got == want
        assert_same_state(ucp.load(root / "global_step2"), ucp.load(sync_root / "global_step2"))

        resumed = engine(1, {}, decoupled=False)  # another ZeRO stage, synchronous saves
        try:
            assert resumed.load_checkpoint(root) == (str(root / "global_step2"), {"epoch": 1})
            assert train_steps(resumed, range(2, 4)) == want[2:]
        finally:
            resumed.close()
    finally:
        saver.close()


def test_a_failed_decoupled_save_raises_at_the_next_wait_point_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault: the copy of a swap file the save streams is corrupt on disk, so the writer's CRC check fails."""
    root = tmp_path / "ckpt"
    e = engine(2, nvme(tmp_path / "swap", params=False), decoupled=True)
    try:
        train_steps(e, range(1))
        e.save_checkpoint(root)
        e.wait_checkpoints()
        assert latest(root) == "global_step1"

        monkeypatch.setattr(offload_checkpoint, "copy_file", corrupting(offload_checkpoint.copy_file))
        train_steps(e, range(1, 2))
        lone = tmp_path / "lone"
        handle = e.save(lone)
        assert isinstance(handle, ucp.SaveHandle)
        assert handle.exception() is not None  # over: the next optimizer step reports it, once applied
        with pytest.raises(ucp.CheckpointError, match=f"decoupled save of checkpoint {re.escape(str(lone))} failed"):
            train_steps(e, range(2, 3))
        assert e.global_steps == 3 and not lone.exists()

        e.save_checkpoint(root)  # one save in flight: the next save waits for it, and raises its failure
        where = re.escape(str(root / "global_step3"))
        with pytest.raises(ucp.CheckpointError, match=where) as failed:
            e.save_checkpoint(root, tag="next")
        assert isinstance(failed.value.__cause__, OffloadError)

        e.save_checkpoint(root, tag="last")
        with pytest.raises(ucp.CheckpointError, match=re.escape(str(root / "last"))):
            e.close()
    finally:
        e.close()
    assert latest(root) == "global_step1"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["global_step1", "latest"]
    fresh = engine(1, {}, decoupled=False)
    try:
        assert fresh.load_checkpoint(root)[0] == str(root / "global_step1") and fresh.global_steps == 1
    finally:
        fresh.close()


def test_two_ranks_decoupled_save_is_the_sync_save_and_a_failure_on_one_rank_raises_on_both(tmp_path: Path) -> None:
    """A gloo world of 2 ranks at ZeRO-2: a decoupled save_checkpoint (the ranks agree on its tag and, at each
    step, on whether it is over) writes the synchronous save's checkpoint, and the run's losses are the same.

    Then (module_engine_worker.faults, the optimizer on NVMe) saves that fail on rank 1 only raise a
    CheckpointError naming the checkpoint on both ranks at the same call: one whose state rank 1 cannot encode
    (rank 0's saver started it; rank 1's did not), one whose copy of rank 1's swap files is corrupt; different
    tags raise ValueError on both; none of these leaves a checkpoint or moves latest, and a save after them works.
    A synchronous save whose latest rank 0 cannot write raises on both ranks (rank 0 its OSError)."""
    base = {"stage": 2, "micro": 2, "gas": 1, "steps": [0, 4], "save_at": 2}
    faults, swap = tmp_path / "faults", tmp_path / "swap"
    swap.mkdir()
    scenarios = [
        {**base, "name": "sync", "save": str(tmp_path / "sync")},
        {**base, "name": "decoupled", "save": str(tmp_path / "decoupled"), "checkpoint": DECOUPLED},
        {
            "name": "faults",
            "faults": True,
            "micro": 2,
            "save": str(faults),
            "nvme": str(swap),
            "checkpoint": DECOUPLED,
        },
    ]
    run_world(2, scenarios, tmp_path / "world", timeout=240, worker=WORKER)
    losses = {s["name"]: json.loads((tmp_path / "world" / f"{s['name']}.json").read_text()) for s in scenarios[:2]}
    assert losses["decoupled"] == losses["sync"]
    assert latest(tmp_path / "decoupled") == latest(tmp_path / "sync") == "global_step2"
    assert_same_state(ucp.load(tmp_path / "decoupled" / "global_step2"), ucp.load(tmp_path / "sync" / "global_step2"))

    seen = [json.loads((tmp_path / "world" / f"faults-rank{r}.json").read_text()) for r in range(2)]
    start = f"the decoupled save of checkpoint {faults / 'unsaveable'} failed to start"
    assert seen[0]["start"] == ["CheckpointError", f"{start} on another rank (see its error)"]
    assert seen[1]["start"][0] == "CheckpointError" and seen[1]["start"][1].startswith(f"{start}: ")
    assert "builtins.set cannot be saved" in seen[1]["start"][1]
    # rank 1 failed before its saver: rank 0 did not enter the saver's collectives alone (no hang), both raise
    early = f"the decoupled save of checkpoint {faults / 'uncopied'} failed to start"
    assert seen[0]["early"] == ["CheckpointError", f"{early} on another rank (see its error)"]
    assert seen[1]["early"] == ["CheckpointError", f"{early}: [Errno 28] no room for the copy"]
    # the same call on both ranks (the step after which, or wait_checkpoints), each naming the checkpoint
    assert seen[0]["corrupt"][:2] == seen[1]["corrupt"][:2]
    for rank in range(2):
        kind, message = seen[rank]["corrupt"][2]
        assert kind == "CheckpointError", message
        assert message.startswith(f"the decoupled save of checkpoint {faults / 'corrupt'} failed"), message
        assert "after rank 0 had committed it" not in message
        assert seen[rank]["tags"] == [
            "ValueError",
            f"save_checkpoint: the ranks gave different tags (this rank: 'rank{rank}'); give them all one",
        ]
    assert "CRC" in seen[1]["corrupt"][2][1]  # rank 1's own error: its copy did not match
    assert seen[0]["latest"][0] == "IsADirectoryError" and ".latest.tmp" in seen[0]["latest"][1]
    assert seen[1]["latest"] == [
        "CheckpointError",
        f"{faults / 'sync'} is saved, but rank 0 could not write {faults / 'latest'} (see its error)",
    ]
    assert latest(faults) == "after"
    names = sorted(p.name for p in faults.iterdir() if not p.name.startswith("."))
    assert names == ["after", "global_step1", "latest", "sync"]
