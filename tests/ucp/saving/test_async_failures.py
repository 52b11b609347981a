"""Failures around asynchronous saves (ucp.saving.async_save, ucp.saving.background, ucp.saving.staging, ucp.manager).

Failures in the middle of a save, interleaved with good saves, in every mode: the error raised, the
bytes committed, what is left on disk, and whether the saver still works afterwards.
"""

from __future__ import annotations

import errno
import glob
import os
import signal
import sys
import threading
import time

import pytest  # noqa: E402
import torch  # noqa: E402
from ucp_helpers import assert_same_state, random_tensor, same_bytes  # noqa: E402

import ucp  # noqa: E402
import ucp.saving.background.execute as bg  # noqa: E402
import ucp.saving.snapshot as snapshot_mod  # noqa: E402
from ucp.errors import CheckpointError, CommitError  # noqa: E402
from ucp.manager import CheckpointManager, read_latest  # noqa: E402
from ucp.saving.async_save import AsyncSaver  # noqa: E402

MODES = ["thread", "process"]


def state_of(seed: int) -> dict:
    """A small state with several dtypes and a non-contiguous tensor (bytes differ for every seed)."""
    return {
        "w": random_tensor(torch.float32, (256, 128), seed),
        "t": random_tensor(torch.float64, (24, 16), seed + 1).t(),
        "h": random_tensor(torch.bfloat16, (77,), seed + 2),
        "step": seed,
    }


def clone(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def scribble(state: dict) -> None:
    """What training does right after the save returned: change every tensor in place."""
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.zero_()


def fds_under(path) -> list[str]:
    """This process's open file descriptors on anything under ``path`` (e.g. a temp dir's lock)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


def arena_is_free(saver: AsyncSaver, timeout: float = 3.0) -> bool:
    """Whether the saver's (max_in_flight=1) staging arena can be taken now, i.e. nothing holds it."""
    try:
        arena = saver.pool.acquire(1, timeout=timeout)
    except TimeoutError:
        return False
    saver.pool.release(arena)
    return True


def failing_snapshot(plan, leaves, arena, progress, stream_for, **kw):
    """The header is copied, then the copy breaks (a bad tensor, Ctrl-C, ...)."""
    arena.view(plan.data_start)[:] = plan.header
    progress.advance(plan.data_start)
    raise RuntimeError("copy broke")


# -- failures in the middle of a snapshot --------------------------------------------------------


@pytest.mark.parametrize(
    "mode,snapshot", [("thread", "sync"), ("thread", "background"), ("process", "sync"), ("process", "background")]
)
def test_a_snapshot_failing_midway_gives_back_arena_lock_and_temp_dir(tmp_path, monkeypatch, mode, snapshot):
    real = snapshot_mod.snapshot_into
    with AsyncSaver(mode=mode, snapshot=snapshot) as saver:
        monkeypatch.setattr(snapshot_mod, "snapshot_into", failing_snapshot)
        if snapshot == "sync":
            with pytest.raises(RuntimeError, match="copy broke"):
                saver.save(state_of(1), tmp_path / "bad", step=1)
        else:
            h = saver.save(state_of(1), tmp_path / "bad", step=1)
            h.wait_snapshot(timeout=30)
            with pytest.raises(CheckpointError, match="copy broke"):
                h.result(timeout=30)
        monkeypatch.setattr(snapshot_mod, "snapshot_into", real)
        assert os.listdir(tmp_path) == []  # the temporary directory is gone
        assert fds_under(tmp_path) == []  # its lock is closed
        assert arena_is_free(saver)
        state = state_of(2)
        expected = clone(state)
        h = saver.save(state, tmp_path / "good", step=2)
        h.wait_snapshot(timeout=30)
        scribble(state)
        assert h.result(timeout=30).step == 2
        assert saver.pool.created == 1  # the one arena, reused
    assert_same_state(expected, ucp.load(tmp_path / "good"))
    assert sorted(os.listdir(tmp_path)) == ["good"]


def test_no_snapshot_mode_write_failure_frees_the_tensors_and_cleans_up(tmp_path, monkeypatch):
    real = bg.write_rank_file

    def enospc(storage, rel, plan, views):
        raise OSError(errno.ENOSPC, "No space left on device", storage.path(rel))

    with AsyncSaver(snapshot="none") as saver:
        monkeypatch.setattr(bg, "write_rank_file", enospc)
        h = saver.save(state_of(3), tmp_path / "bad")
        h.wait_snapshot(timeout=30)  # the tensors are free again even though the write failed
        with pytest.raises(OSError) as info:
            h.result(timeout=30)
        assert info.value.errno == errno.ENOSPC and "rank-00000.safetensors" in info.value.filename
        monkeypatch.setattr(bg, "write_rank_file", real)
        assert os.listdir(tmp_path) == [] and fds_under(tmp_path) == []
        state = state_of(4)
        saver.save(state, tmp_path / "good").result(timeout=30)
    assert_same_state(state, ucp.load(tmp_path / "good"))


@pytest.mark.parametrize("mode", MODES)
def test_max_in_flight_two_with_interleaved_failures_keeps_every_good_save_exact(tmp_path, monkeypatch, mode):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "precious.txt").write_text("user data")
    real = snapshot_mod.snapshot_into
    good: dict[str, tuple] = {}
    with AsyncSaver(mode=mode, max_in_flight=2, snapshot="sync") as saver:  # the copy made before returning fails
        for i, kind in enumerate(["ok", "snapshot fails", "ok", "commit fails", "ok", "ok"]):
            state = state_of(10 * i)
            expected = clone(state)
            if kind == "snapshot fails":
                monkeypatch.setattr(snapshot_mod, "snapshot_into", failing_snapshot)
                with pytest.raises(RuntimeError, match="copy broke"):
                    saver.save(state, tmp_path / f"c{i}", step=i)
                monkeypatch.setattr(snapshot_mod, "snapshot_into", real)
            elif kind == "commit fails":
                bad = saver.save(state, tmp_path / "taken", step=i)
            else:
                good[f"c{i}"] = (saver.save(state, tmp_path / f"c{i}", step=i), expected, i)
            scribble(state)
        with pytest.raises(CheckpointError, match="not a checkpoint"):
            bad.result(timeout=60)
        for name, (h, expected, step) in good.items():
            assert h.result(timeout=60).step == step
            assert_same_state(expected, ucp.load(tmp_path / name))
        assert saver.pool.created <= 2
    assert sorted(os.listdir(tmp_path)) == sorted(list(good) + ["taken"])
    assert os.listdir(tmp_path / "taken") == ["precious.txt"]
    assert fds_under(tmp_path) == []


# -- paths -----------------------------------------------------------------------------------------


def test_a_missing_parent_is_created_and_a_file_parent_fails_at_once(tmp_path):
    with AsyncSaver() as saver:
        state = state_of(5)
        saver.save(state, tmp_path / "a" / "b" / "ck", step=5).result(timeout=30)
        assert_same_state(state, ucp.load(tmp_path / "a" / "b" / "ck"))
        (tmp_path / "file").write_text("not a directory")
        with pytest.raises(OSError):
            saver.save(state, tmp_path / "file" / "ck")
        assert (tmp_path / "file").read_text() == "not a directory"
        assert arena_is_free(saver)
        saver.save(state, tmp_path / "after").result(timeout=30)
    assert sorted(os.listdir(tmp_path)) == ["a", "after", "file"]


def test_a_path_that_cannot_be_opened_gives_its_staging_back(tmp_path):
    with AsyncSaver(max_in_flight=1) as saver:
        with pytest.raises(ValueError, match="nosuchproto"):
            saver.save(state_of(6), "nosuchproto://bucket/ck")
        assert arena_is_free(saver), "the failed save still holds the only staging arena"


def test_relative_path_process_mode_resolves_against_the_cwd_of_the_call(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with AsyncSaver(mode="process") as saver:
        saver.start()
        monkeypatch.chdir(tmp_path / "b")
        state = state_of(7)
        h = saver.save(state, "ck", step=7)
        try:
            h.result(timeout=30)
        finally:
            leftovers = os.listdir(tmp_path / "b")
        assert leftovers == ["ck"]
    assert_same_state(state, ucp.load(tmp_path / "b" / "ck"))


def test_relative_path_thread_mode_resolves_against_the_cwd_of_the_call(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    gate, real = threading.Event(), bg.write_image

    def held(*args, **kw):  # the first save holds the writer thread until the test lets it go
        assert gate.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(bg, "write_image", held)
    monkeypatch.chdir(tmp_path / "a")
    with AsyncSaver(max_in_flight=2) as saver:
        first = saver.save(state_of(8), tmp_path / "first")
        state = state_of(9)
        second = saver.save(state, "ck", step=9)  # means <tmp>/a/ck: that is where its temp dir is made
        monkeypatch.chdir(tmp_path / "b")
        gate.set()
        first.result(timeout=30)
        second.result(timeout=30)
    assert_same_state(state, ucp.load(tmp_path / "a" / "ck"))


# -- handles, close, concurrency -------------------------------------------------------------------


def test_result_timeout_raises_timeout_error_and_the_save_goes_on(tmp_path, monkeypatch):
    gate, real = threading.Event(), bg.write_image

    def held(*args, **kw):
        assert gate.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(bg, "write_image", held)
    with AsyncSaver() as saver:
        state = state_of(11)
        h = saver.save(state, tmp_path / "ck", step=11)
        with pytest.raises(TimeoutError):
            h.result(timeout=0.05)
        assert not h.done()
        gate.set()
        assert h.result(timeout=30).step == 11
    assert_same_state(state, ucp.load(tmp_path / "ck"))


def test_close_during_a_background_copy_waits_for_it_and_commits(tmp_path, monkeypatch):
    gate, real = threading.Event(), snapshot_mod.snapshot_into

    def held(*args, **kw):
        assert gate.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(snapshot_mod, "snapshot_into", held)
    saver = AsyncSaver(snapshot="background")
    state = state_of(12)
    expected = clone(state)
    h = saver.save(state, tmp_path / "ck", step=12)
    closer = threading.Thread(target=saver.close)
    closer.start()
    assert not h.snapshot_done()
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert h.done() and h.result(timeout=0).step == 12
    assert_same_state(expected, ucp.load(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    with pytest.raises(RuntimeError, match="closed"):
        saver.save(state, tmp_path / "late")


def test_process_close_without_wait_still_commits_saves_in_flight_and_frees_shm(tmp_path):
    saver = AsyncSaver(mode="process", max_in_flight=2)
    states = [state_of(20), state_of(21)]
    expected = [clone(s) for s in states]
    handles = [saver.save(s, tmp_path / f"c{i}", step=i) for i, s in enumerate(states)]
    for s in states:
        scribble(s)
    prefix = saver.pool.prefix
    saver.close(wait=False)
    for i, h in enumerate(handles):
        assert h.result(timeout=30).step == i
        assert_same_state(expected[i], ucp.load(tmp_path / f"c{i}"))
    assert glob.glob(glob.escape(prefix) + "-*") == []  # no staging file left in /dev/shm
    assert sorted(os.listdir(tmp_path)) == ["c0", "c1"]


def test_two_savers_racing_on_one_path_leave_one_whole_checkpoint(tmp_path):
    with AsyncSaver() as one, AsyncSaver() as two:
        for round_ in range(4):
            states = [state_of(100 + 2 * round_), state_of(101 + 2 * round_)]
            handles = [s.save(st, tmp_path / "ck", step=round_) for s, st in zip((one, two), states)]
            outcomes = []
            for h, st in zip(handles, states):
                try:
                    h.result(timeout=30)
                    outcomes.append(st)
                except (OSError, CheckpointError):  # the loser of a commit race may fail; never both
                    pass
            assert outcomes, "both racing saves failed"
            back = ucp.load(tmp_path / "ck")
            assert any(same_bytes(back["w"], st["w"]) and back["step"] == st["step"] for st in outcomes)
            assert ucp.verify(tmp_path / "ck").ok
            assert sorted(os.listdir(tmp_path)) == ["ck"]


# -- the writer process dying ----------------------------------------------------------------------


def _kill_writer_with_a_job_queued(saver: AsyncSaver, path) -> ucp.SaveHandle:
    """Stop the writer, hand it a save, then kill it: the job is in its pipe, never run."""
    saver.start()
    pid = saver.writer_pid
    assert pid is not None  # start() started the writer process
    os.kill(pid, signal.SIGSTOP)
    h = saver.save(state_of(30), path, step=30)
    os.kill(pid, signal.SIGKILL)
    return h


def test_a_killed_writer_process_fails_its_save_clearly_and_the_next_save_works(tmp_path):
    with AsyncSaver(mode="process") as saver:
        h = _kill_writer_with_a_job_queued(saver, tmp_path / "ck")
        pid = saver.writer_pid
        with pytest.raises(CommitError, match=r"exited with code -9 before finishing"):
            h.result(timeout=30)
        assert fds_under(tmp_path) == []
        assert arena_is_free(saver)
        state = state_of(31)
        saver.save(state, tmp_path / "next", step=31).result(timeout=60)
        assert saver.writer_pid != pid  # a new writer
    assert_same_state(state, ucp.load(tmp_path / "next"))


def test_a_killed_writer_process_leaves_no_temporary_directory(tmp_path):
    with AsyncSaver(mode="process") as saver:
        h = _kill_writer_with_a_job_queued(saver, tmp_path / "ck")
        with pytest.raises(CommitError):
            h.result(timeout=30)
        assert [n for n in os.listdir(tmp_path) if n.startswith(".ck.tmp-")] == []


def test_a_writer_dying_at_submit_gives_the_staging_back_once(tmp_path):
    with AsyncSaver(mode="process", max_in_flight=1) as saver:
        saver.start()
        backend = saver._backend
        real = backend._send

        def dies_first(proc, msg):  # forces the interleaving: the reader sees the death before the write fails
            if msg.get("op") == "job":
                proc.kill()
                deadline = time.monotonic() + 20
                while backend._proc is not None and time.monotonic() < deadline:
                    time.sleep(0.01)
            return real(proc, msg)

        backend._send = dies_first
        try:  # the save fails, either at once or through its handle
            h = saver.save(state_of(40), tmp_path / "ck")
        except CommitError:
            pass
        else:
            with pytest.raises(CommitError):
                h.result(timeout=30)
        backend._send = real
        first = saver.pool.acquire(1, timeout=5)
        try:
            try:  # max_in_flight=1: while ``first`` is out, no other arena may be handed out
                second = saver.pool.acquire(1, timeout=0.5)
            except TimeoutError:
                second = None
            assert second is None, f"a second arena was handed out (the very same one: {second is first})"
        finally:
            saver.pool.release(first)


def test_a_writer_that_cannot_start_is_reported_at_once(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the writer exits with code 1 at once
    saver = AsyncSaver(mode="process")
    try:
        with pytest.raises(CommitError, match="exit"):
            saver._backend.start(wait=True, timeout=3)
    finally:
        monkeypatch.undo()
        saver.close()


# -- CheckpointManager with asynchronous saves ----------------------------------------------------


def _block_step(root, step: int) -> None:
    """A user's directory where step ``step`` would go: the save of that step fails at its commit."""
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "notes.txt").write_text("mine")


def test_a_failed_async_manager_save_moves_neither_latest_nor_retention(tmp_path):
    _block_step(tmp_path, 2)
    with CheckpointManager(tmp_path, keep_last=1, async_save=True) as m:
        s1 = state_of(1)
        m.save(s1, 1).result(timeout=30)
        h2 = m.save(state_of(2), 2)
        with pytest.raises(CheckpointError, match="not a checkpoint"):
            h2.result(timeout=30)
        assert read_latest(tmp_path) == (1, "step-00000001") and m.latest() == 1
        assert_same_state(s1, m.load())
        s3 = state_of(3)
        m.save(s3, 3).result(timeout=30)
        assert m.latest() == 3
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000002", "step-00000003"]  # step 1 retired
    assert os.listdir(tmp_path / "step-00000002") == ["notes.txt"]
    assert_same_state(s3, ucp.load(tmp_path / "step-00000003"))


def test_manager_wait_reports_a_save_that_failed_before_the_next_one(tmp_path):
    _block_step(tmp_path, 1)
    with CheckpointManager(tmp_path, async_save=True) as m:
        h1 = m.save(state_of(1), 1)
        h1.exception(timeout=30)  # failed and done before the next save is made
        m.save(state_of(2), 2)
        with pytest.raises(CheckpointError, match="not a checkpoint"):
            m.wait()
