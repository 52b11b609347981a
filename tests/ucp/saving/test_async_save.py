"""Asynchronous saves: snapshot isolation, both writer modes, errors, asyncio, trainer death, 2 gloo ranks
(their rank side: tests/support/async_save_worker.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest  # noqa: E402
import torch  # noqa: E402
from async_save_worker import ALL, COW, MODES, make_saver  # noqa: E402
from repo_paths import SUPPORT  # noqa: E402
from ucp_helpers import assert_same_state, random_tensor, same_bytes  # noqa: E402
from world import run_world  # noqa: E402

import ucp  # noqa: E402
from ucp.saving.async_save import AsyncSaver, SaveHandle, aload, asave, async_save, default_saver  # noqa: E402


def awkward_state(seed: int = 0) -> dict:
    """Tensors of many dtypes and layouts (non-contiguous, conjugated, 0-d, empty) plus plain values."""
    big = random_tensor(torch.float32, (1536, 1024), seed)  # 6 MiB: several snapshot chunks when chunks are small
    cplx = random_tensor(torch.complex64, (8, 8), seed + 1)
    return {
        "model": {
            "big": big,
            "t": random_tensor(torch.float64, (64, 48), seed + 2).t(),  # non-contiguous
            "bf": random_tensor(torch.bfloat16, (333,), seed + 3),
            "f8": random_tensor(torch.float8_e4m3fn, (17, 3), seed + 4),
            "b": random_tensor(torch.bool, (9,), seed + 5),
            "c": cplx.conj(),  # conjugate bit set
            "scalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.empty(0, 4),
        },
        "optim": {"state": {0: {"m": random_tensor(torch.float16, (100,), seed + 6)}}, "param_groups": [{"lr": 0.1}]},
        "epoch": 3,
        "name": "run",
    }


def clone_state(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone().resolve_conj()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    return obj


def scribble(obj) -> None:
    """What training does next: change every tensor in place."""
    if isinstance(obj, torch.Tensor):
        if obj.numel():
            if obj.dtype == torch.bool:
                obj.logical_not_()
            elif obj.is_complex():
                obj.mul_(0)
            else:
                obj.reshape(-1).view(torch.uint8).bitwise_not_() if obj.is_contiguous() else obj.zero_()
    elif isinstance(obj, dict):
        for v in obj.values():
            scribble(v)
    elif isinstance(obj, list):
        for v in obj:
            scribble(v)


@pytest.fixture(scope="module")
def savers():
    """One saver per mode for the whole module (a process-mode writer takes seconds to start); both
    pipelined (not the default), so the writer follows the copy (in process mode: progress messages)."""
    made = {m: make_saver(m, pipeline=True) for m in ALL}
    yield made
    for s in made.values():
        s.close()


@pytest.mark.parametrize("mode", ALL)
def test_checkpoint_holds_the_values_of_the_moment_of_the_call(tmp_path, savers, mode, monkeypatch):
    # many progress steps: the writer follows the copy
    monkeypatch.setattr(sys.modules["ucp.saving.snapshot"], "COPY_CHUNK", 1 << 20)
    saver = savers[mode]
    state = awkward_state()
    expected = clone_state(state)
    handle = saver.save(state, tmp_path / "ck", step=11, metadata={"k": "v"})
    scribble(state)  # right after the call returns
    assert not same_bytes(state["model"]["big"], expected["model"]["big"])
    manifest = handle.result(timeout=120)
    assert handle.done() and manifest.step == 11 and manifest.metadata == {"k": "v"}
    assert_same_state(expected, ucp.load(tmp_path / "ck"))
    assert ucp.verify(tmp_path / "ck").ok
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary directory left
    assert sorted(os.listdir(tmp_path / "ck")) == ["manifest.json", "rank-00000.safetensors"]


@pytest.mark.parametrize("snapshot", ["sync", "background", "none"] + ([COW] if COW else []))
def test_prepare_allocates_the_staging_the_first_save_then_uses(tmp_path, snapshot):
    state = {"w": random_tensor(torch.float32, (512, 300), 2), "b": random_tensor(torch.bfloat16, (77,), 3), "step": 0}
    with AsyncSaver(snapshot=snapshot) as saver:
        reserved = saver.prepare(state)
        assert saver.pool.created == (0 if snapshot == "none" else 1)
        handle = saver.save(state, tmp_path / "ck", step=1)
        handle.wait_snapshot()
        handle.result(timeout=120)
        assert saver.pool.created == (0 if snapshot == "none" else 1)  # the save found it: nothing new allocated
    rank_file = (tmp_path / "ck" / "rank-00000.safetensors").stat().st_size
    assert reserved == (0 if snapshot == "none" else rank_file)
    assert_same_state(state, ucp.load(tmp_path / "ck"))
    manager = ucp.CheckpointManager(tmp_path / "sync-root")
    assert manager.prepare(state) == 0  # a synchronous manager stages nothing


@pytest.mark.parametrize("mode", ALL)
def test_staging_is_reused_and_saves_replace_each_other(tmp_path, savers, mode):
    saver = savers[mode]
    created = saver.pool.created
    state = {"w": random_tensor(torch.float32, (256, 256), 1), "step": 0}
    for step in range(3):
        state["w"].add_(1)
        state["step"] = step
        saver.save(state, tmp_path / "ck", step=step).result(timeout=120)
        back = ucp.load(tmp_path / "ck")
        assert back["step"] == step and same_bytes(back["w"], state["w"])
    assert saver.pool.created <= created + 1  # at most one new arena for this layout, reused after that
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_data_files_are_byte_identical_to_a_synchronous_save(tmp_path):
    state = awkward_state(5)
    ucp.save(state, tmp_path / "sync")
    async_save(state, tmp_path / "async").result()
    name = "rank-00000.safetensors"
    assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes()


def test_module_level_async_save_and_handle_api(tmp_path):
    state = {"a": torch.arange(10.0)}
    h = async_save(state, tmp_path / "x", step=1)
    assert isinstance(h, SaveHandle) and h.snapshot_seconds >= 0 and h.path.endswith("x")
    state["a"].zero_()
    assert h.result().step == 1 and h.exception() is None and "x" in repr(h)
    assert torch.equal(ucp.load(tmp_path / "x")["a"], torch.arange(10.0))
    seen = []
    h.add_done_callback(seen.append)  # already done: called at once
    assert seen == [h]
    assert default_saver() is default_saver()


def test_errors_before_the_snapshot_raise_at_once_and_leave_nothing(tmp_path):
    with pytest.raises(ucp.UnsupportedStateError, match="complex128|cannot be saved"):
        async_save({"x": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "a")
    with pytest.raises(ucp.UnsupportedStateError):
        async_save({"x": {1, 2}}, tmp_path / "a")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ALL)
def test_errors_after_return_come_from_result_and_clean_up(tmp_path, savers, mode):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "precious.txt").write_text("user data")
    h = savers[mode].save({"x": torch.ones(3)}, tmp_path / "taken")
    with pytest.raises(ucp.CheckpointError, match="not a checkpoint"):
        h.result(timeout=120)
    assert sorted(os.listdir(tmp_path)) == ["taken"]  # the temporary directory is gone
    assert (tmp_path / "taken" / "precious.txt").read_text() == "user data"
    # the saver still works afterwards
    savers[mode].save({"x": torch.ones(3)}, tmp_path / "ok").result(timeout=120)
    assert ucp.verify(tmp_path / "ok").ok


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pipeline", [True, False])
def test_a_failed_snapshot_raises_cleans_up_and_frees_its_staging(tmp_path, savers, mode, pipeline, monkeypatch):
    module = sys.modules["ucp.saving.snapshot"]
    real = module.snapshot_into

    def half_then_fail(plan, leaves, arena, progress, stream_for, **kw):
        progress.advance(plan.data_start)
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the copy

    saver = savers[mode]
    monkeypatch.setattr(saver, "pipeline", pipeline)
    monkeypatch.setattr(module, "snapshot_into", half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        saver.save({"w": torch.ones(1000)}, tmp_path / "ck")
    monkeypatch.setattr(module, "snapshot_into", real)
    h = saver.save({"w": torch.ones(1000)}, tmp_path / "ck2")  # max_in_flight=1: the arena came back
    h.result(timeout=120)
    saver.wait()
    assert sorted(os.listdir(tmp_path)) == ["ck2"]


def test_no_snapshot_writes_from_the_tensors_and_frees_them_once_written(tmp_path):
    state = awkward_state(8)
    expected = clone_state(state)
    with AsyncSaver(snapshot="none") as saver:
        h = saver.save(state, tmp_path / "ck", step=4)
        h.wait_snapshot(timeout=120)  # the data file is written: the tensors are free
        assert h.snapshot_done() and saver.pool.created == 0  # no staging memory at all
        scribble(state)
        assert h.result(timeout=120).step == 4
        # the same bytes as a synchronous save of the same tensors
        h2 = saver.save(expected, tmp_path / "again")
        h2.result(timeout=120)
    ucp.save(expected, tmp_path / "sync")
    name = "rank-00000.safetensors"
    assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    assert_same_state(expected, ucp.load(tmp_path / "ck"))
    with pytest.raises(ValueError, match="mode='thread'"):
        AsyncSaver(mode="process", snapshot="none")


@pytest.mark.parametrize("mode", MODES)
def test_background_snapshot_returns_before_the_copy_and_saves_the_values_of_the_call(tmp_path, mode, monkeypatch):
    module = sys.modules["ucp.saving.snapshot"]
    monkeypatch.setattr(module, "COPY_CHUNK", 1 << 20)
    real, release = module.snapshot_into, __import__("threading").Event()

    def held_back(*args, **kw):  # the copy starts only when the test says so
        assert release.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(module, "snapshot_into", held_back)
    state = awkward_state(7)
    expected = clone_state(state)
    with AsyncSaver(mode=mode, snapshot="background") as saver:
        h = saver.save(state, tmp_path / "ck", step=3)
        assert not h.snapshot_done() and not h.done()  # save() returned before copying anything
        release.set()
        h.wait_snapshot(timeout=120)
        assert h.snapshot_done()
        scribble(state)  # what the optimizer step does next
        assert h.result(timeout=120).step == 3
    assert_same_state(expected, ucp.load(tmp_path / "ck"))
    assert ucp.verify(tmp_path / "ck").ok


def test_a_failed_background_snapshot_fails_the_save_not_the_wait(tmp_path, monkeypatch):
    module = sys.modules["ucp.saving.snapshot"]
    real = module.snapshot_into

    def fail(*args, **kw):
        raise RuntimeError("copy broke")

    with AsyncSaver(snapshot="background") as saver:
        monkeypatch.setattr(module, "snapshot_into", fail)
        h = saver.save({"w": torch.ones(1000)}, tmp_path / "ck")
        h.wait_snapshot(timeout=60)  # returns: nothing is left to protect
        with pytest.raises(ucp.CheckpointError, match="copy broke"):
            h.result(timeout=60)
        monkeypatch.setattr(module, "snapshot_into", real)
        saver.save({"w": torch.ones(1000)}, tmp_path / "ck2").result(timeout=60)  # the arena came back
    assert sorted(os.listdir(tmp_path)) == ["ck2"]
    with pytest.raises(ValueError, match="snapshot"):
        AsyncSaver(snapshot="lazy")


def test_max_in_flight_two_keeps_two_snapshots(tmp_path):
    with AsyncSaver(max_in_flight=2) as saver:
        a = {"w": torch.full((1 << 18,), 1.0)}
        handles = [saver.save(a, tmp_path / f"c{i}", step=i) for i in range(4)]
        a["w"].fill_(9.0)
        for i, h in enumerate(handles):
            assert h.result(timeout=120).step == i
        assert saver.pool.created <= 2
    for i in range(4):
        assert torch.equal(ucp.load(tmp_path / f"c{i}")["w"], torch.full((1 << 18,), 1.0))


def test_asyncio_faces(tmp_path):
    state = {"m": {"w": random_tensor(torch.float32, (64, 32), 3)}, "step": 5}

    async def main():
        m = await asave(state, tmp_path / "a", step=5)
        assert m.step == 5
        full = await aload(tmp_path / "a")
        into = {"m": {"w": torch.zeros(64, 32)}, "step": 0}
        await aload(tmp_path / "a", into=into)
        h = async_save(state, tmp_path / "b", step=6)
        m2 = await h  # a SaveHandle is awaitable
        with pytest.raises(ucp.NotACheckpointError):
            await aload(tmp_path / "missing")
        return full, into, m2

    full, into, m2 = asyncio.run(main())
    assert_same_state(state, full)
    assert_same_state(state, into)
    assert m2.step == 6 and ucp.verify(tmp_path / "b").ok


# -- several ranks simulated by threads (fast checks of the file-based commit) ---------------------


def test_three_ranks_one_writing_nothing(tmp_path):
    from ucp_helpers import run_ranks

    full = random_tensor(torch.float32, (6, 4), 41)

    def fn(group):
        rank = group.rank
        rows = slice(0, 3) if rank != 1 else slice(3, 6)
        piece = ucp.ShardedTensor(full[rows].clone(), (6, 4), (rows.start, 0), replica_id=1 if rank == 2 else 0)
        with AsyncSaver() as saver:
            h = saver.save({"w": piece, f"r{rank}": rank}, tmp_path / "ck", process_group=group, step=3)
            piece.local.zero_()
            return h.result(timeout=60)

    manifests = run_ranks(3, fn)
    assert all(m.step == 3 and m.topology.world_size == 3 for m in manifests)
    assert sorted(manifests[2].files) == ["rank-00000.safetensors", "rank-00001.safetensors"]  # rank 2: no file
    back = ucp.load(tmp_path / "ck")
    assert same_bytes(back["w"], full) and (back["r0"], back["r1"], back["r2"]) == (0, 1, 2)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_rank_failing_to_write_fails_the_save_everywhere(tmp_path, monkeypatch):
    import errno

    from ucp_helpers import run_ranks

    from ucp.saving.background import execute as background

    real = background.write_image

    def failing(storage, rel, plan, arena, progress):
        if plan.file == "rank-00001.safetensors":
            raise OSError(errno.EIO, "injected failure", rel)
        return real(storage, rel, plan, arena, progress)

    monkeypatch.setattr(background, "write_image", failing)

    def fn(group):
        piece = ucp.ShardedTensor(torch.ones(2, 2), (4, 2), (2 * group.rank, 0))
        with AsyncSaver() as saver:
            return saver.save({"w": piece}, tmp_path / "ck", process_group=group).exception(timeout=60)

    errors = run_ranks(2, fn)
    assert isinstance(errors[1], OSError) and "injected" in str(errors[1])
    assert isinstance(errors[0], ucp.CommitError) and "rank 1" in str(errors[0]) and "injected" in str(errors[0])
    assert os.listdir(tmp_path) == []


# -- the trainer dies right after async_save returned (process mode) -------------------------------

DYING_TRAINER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    from ucp.saving.async_save import AsyncSaver
    from ucp_helpers import random_tensor
    saver = AsyncSaver(mode="process")
    state = {{"w": random_tensor(torch.float32, (4 << 20,), 21), "v": random_tensor(torch.bfloat16, (1 << 20,), 22)}}
    saver.save(state, {path!r}, step=42)
    print(saver.writer_pid, os.getpid(), flush=True)
    {death}
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def test_writer_process_commits_after_the_trainer_died(tmp_path):
    """The trainer exits with os._exit right after async_save returned (tools/crash_harness.py's
    ``async`` trials SIGKILL trainers at random moments instead)."""
    code = DYING_TRAINER.format(tests=str(SUPPORT), path=str(tmp_path / "ck"), death="os._exit(0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip(), r.stderr
    writer, trainer = (int(x) for x in r.stdout.split())
    deadline = time.monotonic() + 60
    while not _gone(writer):
        assert time.monotonic() < deadline, "the orphaned writer did not exit"
        time.sleep(0.05)
    state = ucp.load(tmp_path / "ck")
    assert same_bytes(state["w"], random_tensor(torch.float32, (4 << 20,), 21))
    assert same_bytes(state["v"], random_tensor(torch.bfloat16, (1 << 20,), 22))
    assert ucp.read_manifest(tmp_path / "ck").step == 42
    leaked = [f for f in os.listdir("/dev/shm") if f.startswith(f"ucp-staging-{trainer}-")]
    assert not leaked, f"staging files left behind: {leaked}"
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# -- two real ranks (torch.distributed, gloo) -----------------------------------------------------


@pytest.mark.timeout(300)
def test_two_gloo_ranks_async_save_commit_through_files(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    run_world(SUPPORT / "async_save_worker.py", lambda r: [r, 2, tmp_path / "init", ck], 2, timeout=240)
    m = ucp.read_manifest(ck / "process")
    assert m.topology.mesh == {"dp": 2} and m.step == 8


def test_a_save_cancelled_while_queued_gives_everything_back(tmp_path, monkeypatch):
    """The writer runs saves one at a time; one cancelled before its turn frees its tensors and temp dir."""
    import threading

    import ucp.saving.background.execute as bg

    gate, real = threading.Event(), bg.write_rank_file

    def slow(*args, **kw):  # the first save holds the writer until the test lets it go
        assert gate.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(bg, "write_rank_file", slow)
    with AsyncSaver(snapshot="none", max_in_flight=2) as saver:
        first = saver.save({"w": torch.ones(100)}, tmp_path / "a")
        second = saver.save({"w": torch.ones(100)}, tmp_path / "b")
        assert second.future.cancel()  # still queued behind the first
        gate.set()
        first.result(timeout=60)
        second.wait_snapshot(timeout=60)  # its tensors were given back
        saver.save({"w": torch.ones(100)}, tmp_path / "c").result(timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["a", "c"]  # no temporary directory of the cancelled save
