"""Edge cases of copy-on-write snapshots (ucp/saving/cow/snapshot.py, ucp/saving/cow/helper.py, AsyncSaver(snapshot="cow")), from a
review that found twelve bugs (wrong bytes after abandoned jobs and shared memory, failed saves committed,
no fallback when the helper cannot start, leaks); each is now a passing test here.

Every scenario runs in a child Python process with a hard timeout: a write blocked on a
write-protected page while holding the GIL would otherwise freeze the whole test run. The
scenario bodies are the ``_body_*`` functions below; each test starts one and checks that it
exited cleanly (a failing assertion in the body prints its traceback and exits non-zero).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from repo_paths import REPO
from ucp_helpers import assert_same_state, random_tensor  # noqa: E402

import ucp  # noqa: E402
from ucp.saving.async_save import AsyncSaver  # noqa: E402
from ucp.saving.cow import snapshot as ucp_cow  # noqa: E402

needs_cow = pytest.mark.skipif(
    ucp_cow.cow_unavailable() is not None, reason=f"copy-on-write snapshots unavailable: {ucp_cow.cow_unavailable()}"
)


# -- running a scenario in a child process -------------------------------------------------------


def _text(out: bytes | str | None) -> str:
    """A TimeoutExpired's output: bytes even under text=True (the subprocess docs say so)."""
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def run_body(name: str, tmp_path: Path, timeout: float = 120.0) -> str:
    """Run ``_body_<name>(tmp_path)`` in a fresh interpreter; fail with its output if it fails or hangs."""
    code = (
        "import faulthandler, sys\n"
        f"faulthandler.dump_traceback_later({timeout - 10!r}, exit=True)\n"  # a hang shows every thread's stack
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import test_cow_failures as m\n"
        f"m._body_{name}(sys.argv[1])\n"
        "print('BODY-OK', flush=True)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=str(REPO),
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"scenario {name} hung for {timeout}s:\n{_text(exc.stdout)}\n{_text(exc.stderr)}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "BODY-OK" in proc.stdout, f"scenario {name} failed (rc {proc.returncode}):\n{out}"
    return out


def send_then_raise(real):
    """A ``send_message`` that sends a job, then raises as an interrupt right after it would."""

    def failing(sock, message, *args, **kwargs):
        real(sock, message, *args, **kwargs)
        if message.get("op") == "job":
            raise RuntimeError("interrupted after sending")

    return failing


def clone(state: dict) -> dict:
    return {k: v.detach().clone().resolve_conj() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def in_thread(fn, timeout: float) -> bool:
    """Run ``fn`` on a daemon thread; whether it finished within ``timeout`` (it must release the GIL to block)."""
    done = threading.Event()
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            err.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    ok = done.wait(timeout)
    if err:
        raise err[0]
    return ok


def cow_of(saver: AsyncSaver) -> ucp_cow.CowSnapshots:
    """The saver's copy-on-write snapshots (every saver here asks for them)."""
    assert saver._cow is not None, "no copy-on-write snapshots"
    return saver._cow


def helper_pid(saver: AsyncSaver) -> int:
    assert saver._cow is not None and saver._cow._proc is not None
    return saver._cow._proc.pid


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def my_fds() -> set[str]:
    return {
        f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}"
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    }


def ucp_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("ucp-staging" in line for line in f)


# -- scenario bodies (run in the child) ---------------------------------------------------------


def _body_many_tiny_tensors(tmp: str) -> None:
    dtypes = [
        torch.float32,
        torch.int8,
        torch.bfloat16,
        torch.bool,
        torch.complex64,
        torch.float64,
        torch.float16,
        torch.int64,
        torch.uint8,
        torch.int16,
    ]
    state: dict = {}
    for i in range(3000):
        dt = dtypes[i % len(dtypes)]
        shape = [(), (1,), (3,), (0,), (2, 2)][i % 5]
        state[f"t{i:04d}"] = random_tensor(dt, shape, i)
    state["big"] = random_tensor(torch.float32, (1 << 20,), 9)
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 0.5
        h = saver.save(state, Path(tmp) / "ck", step=1)

        def mutate() -> None:
            for t in state.values():
                if t.numel():
                    t.reshape(-1).view(torch.uint8).bitwise_not_() if t.dtype != torch.bool else t.logical_not_()

        assert in_thread(mutate, 60), "writes to tiny tensors after save never finished"
        h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck"))


def _body_views_of_one_storage(tmp: str) -> None:
    base = random_tensor(torch.float32, (3 << 19,), 1)  # 6 MiB: three helper blocks
    raw = random_tensor(torch.uint8, (5 << 20,), 2)
    state = {
        "a": base[:600000],
        "b": base[400000:],
        "whole": base,
        "same": base,
        "one": base[524287:524289],
        "bytes_mid": raw[4095 : 2 * 1048576 + 3],  # spans a page and a 2 MiB boundary at odd offsets
        "as_int": raw[8 : 4 << 20].view(torch.int32),
        "tail": raw[(5 << 20) - 7 :],
    }
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 0.5
        h = saver.save(state, Path(tmp) / "ck")
        assert in_thread(lambda: (base.mul_(-2), raw.bitwise_not_()), 60)
        h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck"))


def _body_gil_held_python_writes(tmp: str) -> None:
    big = random_tensor(torch.float32, (2048, 1024), 3)  # 8 MiB
    small = random_tensor(torch.int32, (100,), 4)
    state = {"big": big, "small": small}
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 1.0
        h = saver.save(state, Path(tmp) / "ck")
        view = memoryview(big.numpy()).cast("B")
        view[-8:] = b"\x11" * 8  # the last block, a pure Python write holding the GIL
        view[:8] = b"\x22" * 8  # the first block
        view[len(view) // 2 : len(view) // 2 + 8] = b"\x33" * 8
        small.numpy()[:] = 7  # numpy holds the GIL too
        h.result(timeout=60)
        assert cow_of(saver).faulted_blocks >= 3
    assert_same_state(expected, ucp.load(Path(tmp) / "ck"))


def _body_two_savers_same_tensors(tmp: str) -> None:
    state = {"w": random_tensor(torch.float32, (1 << 21,), 5), "s": random_tensor(torch.int64, (77,), 6)}
    first = clone(state)
    with AsyncSaver(snapshot="cow") as s1, AsyncSaver(snapshot="cow") as s2:
        cow_of(s1).pause_before_copy = 0.5
        cow_of(s2).pause_before_copy = 0.5
        h1 = s1.save(state, Path(tmp) / "a")
        h2 = s2.save(state, Path(tmp) / "b")  # the first protects these pages: copied here instead
        assert in_thread(lambda: (state["w"].add_(1), state["s"].zero_()), 60)
        second_state = clone(state)
        h3 = s2.save(state, Path(tmp) / "c")  # while s1 may still protect them
        assert in_thread(lambda: state["w"].add_(1), 60)
        h1.result(timeout=60)
        h2.result(timeout=60)
        h3.result(timeout=60)
    assert_same_state(first, ucp.load(Path(tmp) / "a"))
    assert_same_state(first, ucp.load(Path(tmp) / "b"))
    assert_same_state(second_state, ucp.load(Path(tmp) / "c"))


def _body_close_without_wait(tmp: str) -> None:
    state = {"w": random_tensor(torch.float32, (1 << 21,), 7)}
    expected = clone(state)
    saver = AsyncSaver(snapshot="cow")
    cow_of(saver).pause_before_copy = 1.0
    h = saver.save(state, Path(tmp) / "ck")
    pid = helper_pid(saver)
    assert in_thread(lambda: saver.close(wait=False), 60), "close(wait=False) hung"
    assert in_thread(lambda: state["w"].add_(1), 30)
    h.result(timeout=60)  # the save in flight completes (the writer thread is joined by close)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck"))
    assert not alive(pid), "the helper outlived close()"


def _body_sigstop_then_kill(tmp: str) -> None:
    state = {"w": random_tensor(torch.float32, (1 << 21,), 8), "i": random_tensor(torch.int32, (999,), 9)}
    ucp.save(state, Path(tmp) / "ck", step=1)
    before = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 0.5
        h = saver.save(state, Path(tmp) / "ck", step=2)
        pid = helper_pid(saver)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.8)  # past the pause: the copy would run now, but the helper is stopped
        # The kill comes from another process: a thread blocked on a protected page may hold the GIL
        # (a malloc next to a small tensor's page), so nothing in this process could send it meanwhile.
        kill_at = time.monotonic() + 1.0
        killer = subprocess.Popen(["sh", "-c", f"sleep 1; kill -KILL {pid}"])
        done = threading.Event()
        finished: list[float] = []

        def write() -> None:
            state["w"].add_(1)
            finished.append(time.monotonic())
            done.set()

        threading.Thread(target=write, daemon=True).start()
        assert done.wait(30), "the write stayed blocked after the helper was killed"
        assert killer.wait(10) == 0
        assert finished[0] >= kill_at, "a write to a protected page went through while the helper was stopped"
        with pytest.raises(ucp.CheckpointError, match="copy-on-write helper"):
            h.result(timeout=60)
        assert_same_state(before, ucp.load(Path(tmp) / "ck"))
        assert sorted(os.listdir(tmp)) == ["ck"]
        expected = clone(state)
        h = saver.save(state, Path(tmp) / "ck", step=3)
        assert in_thread(lambda: state["w"].zero_(), 30)
        assert h.result(timeout=60).step == 3
    assert_same_state(expected, ucp.load(Path(tmp) / "ck"))
    assert not alive(pid)


def _body_caller_frees_storage(tmp: str) -> None:
    """The caller frees a saved tensor's memory right after save (FSDP-style storage resize to 0) and
    allocates more: the save fails naming the tensor (never commits someone else's bytes); freeing
    after ``handle.wait_copied()`` is fine."""
    n = 1 << 22  # 16 MiB: its own mmap, unmapped when freed
    w = random_tensor(torch.float32, (n,), 10).clone()  # resizable storage
    state = {"w": w}
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 1.0
        h = saver.save(state, Path(tmp) / "ck")

        def free_and_reuse() -> None:
            w.untyped_storage().resize_(0)
            state["other"] = torch.full((n,), 7.0)

        assert in_thread(free_and_reuse, 30)
        with pytest.raises(ucp.CheckpointError, match=r"tensor 'w': .*freed or (moved|resized)"):
            h.result(timeout=60)
        assert not (Path(tmp) / "ck").exists()
        w2 = random_tensor(torch.float32, (n,), 11).clone()
        expected = clone({"w": w2})
        h = saver.save({"w": w2}, Path(tmp) / "ck2")
        h.wait_copied(timeout=60)
        w2.untyped_storage().resize_(0)
        h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck2"))


def _body_caller_resizes_tensor(tmp: str) -> None:
    """``resize_`` to a larger size right after save moves the data and frees the old memory: the save
    fails naming the tensor; after ``handle.wait_copied()`` the resize is safe."""
    w = random_tensor(torch.float32, (1 << 22,), 11).clone()  # resizable storage
    state = {"w": w, "k": random_tensor(torch.int64, (10,), 12)}
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 1.0
        h = saver.save(state, Path(tmp) / "ck")
        assert in_thread(lambda: w.resize_(1 << 23), 30)
        with pytest.raises(ucp.CheckpointError, match=r"tensor 'w': "):
            h.result(timeout=60)
        w3 = random_tensor(torch.float32, (1 << 22,), 13).clone()
        expected = clone({"w": w3})
        h = saver.save({"w": w3}, Path(tmp) / "ck3")
        h.wait_copied(timeout=60)
        w3.resize_(1 << 23)
        h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck3"))


def _body_caller_replaces_entry(tmp: str) -> None:
    state = {"w": random_tensor(torch.float32, (1 << 22,), 13)}
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 1.0
        h = saver.save(state, Path(tmp) / "ck")
        state["w"] = torch.zeros(1 << 22)  # the old tensor's last reference of the caller goes
        gc.collect()
        junk = [torch.full((1 << 22,), 3.0) for _ in range(3)]  # would land on freed memory
        h.result(timeout=60)
        del junk
    assert_same_state(expected, ucp.load(Path(tmp) / "ck"))


def _body_failure_after_send_releases_pages(tmp: str) -> None:
    """An exception in save after the helper got the job: pages are released, tensors not kept forever."""
    import weakref

    import ucp.saving.cow.snapshot as cow

    real = cow.send_message
    state = {"w": random_tensor(torch.float32, (1 << 21,), 14)}
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 0.5

        cow.send_message = send_then_raise(real)
        try:
            with pytest.raises(RuntimeError, match="interrupted"):
                saver.save(state, Path(tmp) / "ck")
        finally:
            cow.send_message = real
        assert in_thread(lambda: state["w"].add_(1), 30), "a page stayed protected after the failed save"
        for _ in range(100):
            if not cow_of(saver)._pending:
                break
            time.sleep(0.05)
        assert not cow_of(saver)._pending, "the failed snapshot stays pending (and keeps its tensors alive)"
        expected = clone(state)
        h = saver.save(state, Path(tmp) / "ck2")
        assert in_thread(lambda: state["w"].zero_(), 30)
        h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck2"))
    del weakref


def _body_failed_save_is_not_committed(tmp: str) -> None:
    """save() raised (an error after the helper took the job, e.g. Ctrl-C in the wait for its ack); the
    writer started late (busy disk): the helper's completion must not make it commit that save anyway."""
    import ucp.saving.background.thread_backend as bg
    import ucp.saving.cow.snapshot as cow

    real_send, real_execute = cow.send_message, bg.execute
    state = {"w": random_tensor(torch.float32, (1 << 20,), 25)}

    def failing(sock, message, *args, **kwargs):
        real_send(sock, message, *args, **kwargs)
        if message.get("op") == "job":
            raise KeyboardInterrupt

    def slow_execute(*args, **kwargs):
        time.sleep(1.5)
        return real_execute(*args, **kwargs)

    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 0.3
        cow.send_message, bg.execute = failing, slow_execute
        try:
            with pytest.raises(KeyboardInterrupt):
                saver.save(state, Path(tmp) / "ck", step=1)
        finally:
            cow.send_message = real_send
    bg.execute = real_execute
    left = sorted(os.listdir(tmp))
    assert left == [], f"save() raised, yet {left} was written: {sorted(os.listdir(Path(tmp) / left[0]))}"


def _body_unreadable_tensor_error_names_it(tmp: str) -> None:
    """When the helper cannot read a tensor, the save's error names the tensor (not only an address)."""
    w = random_tensor(torch.float32, (1 << 22,), 26).clone()
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 0.5
        h = saver.save({"layer.weight": w}, Path(tmp) / "ck")
        assert in_thread(lambda: w.untyped_storage().resize_(0), 30)
        with pytest.raises(ucp.CheckpointError) as err:
            h.result(timeout=60)
    assert "layer.weight" in str(err.value), f"the error does not name the tensor: {err.value}"


def _body_failure_before_send_does_not_leak(tmp: str) -> None:
    """A non-OSError escaping send_message before anything was sent (e.g. KeyboardInterrupt)."""
    import ucp.saving.cow.snapshot as cow

    real = cow.send_message
    state = {"w": random_tensor(torch.float32, (1 << 21,), 15)}
    with AsyncSaver(snapshot="cow") as saver:
        saver.prepare(state)

        def failing(sock, message, *args, **kwargs):
            if message.get("op") == "job":
                raise KeyboardInterrupt
            real(sock, message, *args, **kwargs)

        cow.send_message = failing
        try:
            with pytest.raises(KeyboardInterrupt):
                saver.save(state, Path(tmp) / "ck")
        finally:
            cow.send_message = real
        assert in_thread(lambda: state["w"].add_(1), 30)
        assert not cow_of(saver)._pending, (
            f"{len(cow_of(saver)._pending)} snapshot(s) never sent stay pending forever, keeping their tensors"
        )
        expected = clone(state)
        h = saver.save(state, Path(tmp) / "ck2")
        h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck2"))


def _body_abandoned_job_writes_into_reused_arena(tmp: str) -> None:
    """A snapshot that failed after the helper took it: its arena goes back to the pool at once, yet the
    helper still copies into it later; the next save (same layout, other tensors) must not get those bytes."""
    import ucp.saving.background.thread_backend as bg
    import ucp.saving.cow.snapshot as cow

    real_send, real_execute = cow.send_message, bg.execute
    n = 1 << 21
    old = {"w": torch.full((n,), 1.0)}
    new = {"w": torch.full((n,), 2.0)}
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 1.5  # the abandoned job copies 1.5 s from now

        cow.send_message = send_then_raise(real_send)
        try:
            with pytest.raises(RuntimeError):
                saver.save(old, Path(tmp) / "old")
        finally:
            cow.send_message = real_send
        cow_of(saver).pause_before_copy = 0.0

        def slow_execute(*args, **kwargs):  # a slow disk: the data file is written 3 s later
            time.sleep(3.0)
            return real_execute(*args, **kwargs)

        bg.execute = slow_execute
        try:
            h = saver.save(new, Path(tmp) / "new")
            assert in_thread(lambda: old["w"].fill_(5.0), 30)  # the abandoned job copies these blocks now
            h.result(timeout=60)
        finally:
            bg.execute = real_execute
    loaded = ucp.load(Path(tmp) / "new")
    assert torch.equal(loaded["w"], new["w"]), (
        f"the checkpoint of 'new' holds {loaded['w'].unique().tolist()}: the abandoned snapshot's bytes"
    )


def _body_protect_timeout_then_helper_resumes(tmp: str) -> None:
    """The helper is stopped when a save starts: after the protect timeout the trainer kills it (so it
    can never write the abandoned job into an arena) and copies itself; later saves copy too."""
    import ucp.saving.cow.snapshot as cow

    n = 1 << 21
    old = {"w": torch.full((n,), 1.0)}
    new = {"w": torch.full((n,), 2.0)}
    cow.PROTECT_TIMEOUT = 1.0
    with AsyncSaver(snapshot="cow") as saver:
        saver.prepare(old)
        pid = helper_pid(saver)
        os.kill(pid, signal.SIGSTOP)
        h = saver.save(old, Path(tmp) / "old")  # waits 1 s, kills the helper, then copies here
        assert not alive(pid)
        assert in_thread(lambda: old["w"].fill_(5.0), 30)
        h.result(timeout=60)
        h = saver.save(new, Path(tmp) / "new")
        new["w"].fill_(3.0)
        h.result(timeout=60)
    assert torch.equal(ucp.load(Path(tmp) / "old")["w"], torch.full((n,), 1.0))
    assert torch.equal(ucp.load(Path(tmp) / "new")["w"], torch.full((n,), 2.0))


def _body_helper_leak_on_gc(tmp: str) -> None:
    state = {"w": random_tensor(torch.float32, (1 << 16,), 16)}
    saver = AsyncSaver(snapshot="cow")
    saver.save(state, Path(tmp) / "ck").result(timeout=60)
    pid = helper_pid(saver)
    del saver
    gc.collect()
    for _ in range(100):
        if not alive(pid):
            break
        time.sleep(0.05)
    assert not alive(pid), "an AsyncSaver dropped without close() leaves its helper process running"


def _body_no_fd_or_mapping_leaks(tmp: str) -> None:
    state = {"w": random_tensor(torch.float32, (1 << 20,), 17), "s": random_tensor(torch.int8, (5,), 18)}
    before = my_fds()
    with AsyncSaver(snapshot="cow") as saver:
        saver.save(state, Path(tmp) / "warm").result(timeout=60)
        pid = helper_pid(saver)
        helper_fds = len(os.listdir(f"/proc/{pid}/fd"))
        mid = my_fds()
        for i in range(15):
            grown = dict(state, extra=torch.zeros(1 << (10 + i % 3 * 8)))  # sizes change: arenas dropped/new
            h = saver.save(grown, Path(tmp) / f"ck{i % 3}")
            state["w"].add_(1)
            h.result(timeout=60)
        time.sleep(0.3)  # the helper handles the last forget/finish messages
        assert len(os.listdir(f"/proc/{pid}/fd")) == helper_fds, "the helper leaks descriptors per save"
        assert ucp_maps(pid) <= saver.pool.max_arenas, "the helper keeps dropped staging arenas mapped"
        assert len(my_fds() - mid) <= 1, f"descriptors leaked over saves: {sorted(my_fds() - mid)}"
    leaked = my_fds() - before
    assert not leaked, f"descriptors left after close(): {sorted(leaked)}"
    assert ucp_maps(os.getpid()) == 0, "staging arenas stay mapped after close()"


def _body_checkpoint_manager_default(tmp: str) -> None:
    state: dict[str, Any] = {"model": {"w": random_tensor(torch.float32, (512, 1024), 19)}, "step": 4}
    with ucp.CheckpointManager(Path(tmp) / "root", keep_last=2, async_save=True) as mgr:
        saver = mgr.saver
        assert saver is not None and saver.snapshot == "cow"
        expected = {"model": {"w": state["model"]["w"].clone()}, "step": 4}
        mgr.save(state, step=4)
        assert in_thread(lambda: state["model"]["w"].zero_(), 30)
        mgr.wait()
        pid = helper_pid(saver)
    steps = [d for d in os.listdir(Path(tmp) / "root") if d != "latest"]
    assert len(steps) == 1, os.listdir(Path(tmp) / "root")
    assert_same_state(expected, ucp.load(Path(tmp) / "root" / steps[0]))
    assert not alive(pid)


def _body_helper_cannot_start(tmp: str) -> None:
    """sys.executable does not start a Python (embedded interpreters): saves copy before returning."""
    sys.executable = "/nonexistent/python"
    state = {"w": random_tensor(torch.float32, (1 << 16,), 20)}
    expected = clone(state)
    with AsyncSaver() as saver:
        h = saver.save(state, Path(tmp) / "ck")
        state["w"].zero_()
        h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck"))


def _body_helper_exits_at_start(tmp: str) -> None:
    """The helper starts but dies at once (broken environment): the save copies before returning."""
    import ucp.saving.cow.snapshot as cow

    class DeadHelper(subprocess.Popen):
        def __init__(self, args, **kwargs):
            super().__init__([sys.executable, "-c", "pass"], **kwargs)
            self.wait()

    state = {"w": random_tensor(torch.float32, (1 << 16,), 21)}
    expected = clone(state)
    with mock.patch.object(cow.subprocess, "Popen", DeadHelper):
        with AsyncSaver(snapshot="cow") as saver:
            h = saver.save(state, Path(tmp) / "ck")
            state["w"].zero_()
            h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck"))


def _body_shared_memory_tensor_written_by_another_process(tmp: str) -> None:
    """A tensor in shared memory (share_memory_(), Hogwild/data-loader workers): a write by another
    process right after save must not reach the checkpoint."""
    w = random_tensor(torch.float32, (1 << 20,), 22).share_memory_()
    state = {"w": w}
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        cow_of(saver).pause_before_copy = 1.0
        h = saver.save(state, Path(tmp) / "ck")
        pid = os.fork()
        if pid == 0:
            try:
                w.fill_(9.0)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "ck"))


def _body_tmpfs_file_tensor_written_through_the_file(tmp: str) -> None:
    """A tensor mapped from a /dev/shm file (shared): a write(2) to that file right after save."""
    path = f"/dev/shm/ucp-review-{os.getpid()}"
    n = 1 << 20
    with open(path, "wb") as f:
        f.write(random_tensor(torch.uint8, (4 * n,), 23).numpy().tobytes())
    try:
        w = torch.from_file(path, shared=True, size=n, dtype=torch.float32)
        state = {"w": w}
        expected = clone(state)
        with AsyncSaver(snapshot="cow") as saver:
            cow_of(saver).pause_before_copy = 1.0
            h = saver.save(state, Path(tmp) / "ck")
            with open(path, "r+b") as f:
                f.write(b"\0" * (4 * n))
            h.result(timeout=60)
        assert_same_state(expected, ucp.load(Path(tmp) / "ck"))
    finally:
        os.unlink(path)


def _body_error_after_helper_death_names_it(tmp: str) -> None:
    """The helper is killed while idle: the next save copies itself and succeeds; no hang, no error."""
    state = {"w": random_tensor(torch.float32, (1 << 20,), 24)}
    with AsyncSaver(snapshot="cow") as saver:
        saver.save(state, Path(tmp) / "a").result(timeout=60)
        pid = helper_pid(saver)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        expected = clone(state)
        h = saver.save(state, Path(tmp) / "b")
        state["w"].zero_()
        h.result(timeout=60)
    assert_same_state(expected, ucp.load(Path(tmp) / "b"))
    assert not alive(pid)


# -- the tests ------------------------------------------------------------------------------------


@needs_cow
def test_many_tiny_tensors_sharing_pages_and_every_dtype(tmp_path):
    run_body("many_tiny_tensors", tmp_path)


@needs_cow
def test_overlapping_views_of_one_storage_and_odd_offsets(tmp_path):
    run_body("views_of_one_storage", tmp_path)


@needs_cow
def test_pure_python_writes_holding_the_gil_while_the_helper_waits(tmp_path):
    run_body("gil_held_python_writes", tmp_path)


@needs_cow
def test_two_savers_over_the_same_tensors(tmp_path):
    run_body("two_savers_same_tensors", tmp_path)


@needs_cow
def test_close_without_waiting_while_the_helper_copies(tmp_path):
    run_body("close_without_wait", tmp_path)


@needs_cow
def test_a_stopped_then_killed_helper_releases_writers_and_fails_the_save(tmp_path):
    run_body("sigstop_then_kill", tmp_path)


@needs_cow
def test_caller_frees_a_saved_tensors_storage_right_after_save(tmp_path):
    run_body("caller_frees_storage", tmp_path)


@needs_cow
def test_caller_resizes_a_saved_tensor_right_after_save(tmp_path):
    run_body("caller_resizes_tensor", tmp_path)


@needs_cow
def test_a_snapshot_that_cannot_read_a_tensor_names_it(tmp_path):
    run_body("unreadable_tensor_error_names_it", tmp_path)


@needs_cow
def test_caller_replaces_a_state_entry_right_after_save(tmp_path):
    run_body("caller_replaces_entry", tmp_path)


@needs_cow
def test_an_error_after_the_job_was_sent_releases_pages(tmp_path):
    run_body("failure_after_send_releases_pages", tmp_path)


@needs_cow
def test_a_save_that_raised_is_not_committed_later(tmp_path):
    run_body("failed_save_is_not_committed", tmp_path)


@needs_cow
def test_an_interrupt_before_the_job_was_sent_does_not_leak_the_snapshot(tmp_path):
    run_body("failure_before_send_does_not_leak", tmp_path)


@needs_cow
def test_an_abandoned_job_does_not_write_into_the_next_saves_arena(tmp_path):
    run_body("abandoned_job_writes_into_reused_arena", tmp_path)


@needs_cow
def test_protect_timeout_then_the_helper_resumes(tmp_path):
    run_body("protect_timeout_then_helper_resumes", tmp_path)


@needs_cow
def test_a_saver_dropped_without_close_does_not_leave_its_helper(tmp_path):
    run_body("helper_leak_on_gc", tmp_path)


@needs_cow
def test_no_descriptor_or_mapping_leaks_over_many_saves(tmp_path):
    run_body("no_fd_or_mapping_leaks", tmp_path)


@needs_cow
def test_checkpoint_manager_async_uses_cow_and_is_exact(tmp_path):
    run_body("checkpoint_manager_default", tmp_path)


@needs_cow
def test_a_helper_that_cannot_be_started_falls_back_to_copying(tmp_path):
    run_body("helper_cannot_start", tmp_path)


@needs_cow
def test_a_helper_that_dies_at_start_falls_back_to_copying(tmp_path):
    run_body("helper_exits_at_start", tmp_path)


@needs_cow
def test_a_shared_memory_tensor_written_by_another_process(tmp_path):
    run_body("shared_memory_tensor_written_by_another_process", tmp_path)


@needs_cow
def test_a_tmpfs_file_tensor_written_through_the_file(tmp_path):
    run_body("tmpfs_file_tensor_written_through_the_file", tmp_path)


@needs_cow
def test_a_helper_killed_while_idle_makes_later_saves_copy(tmp_path):
    run_body("error_after_helper_death_names_it", tmp_path)
