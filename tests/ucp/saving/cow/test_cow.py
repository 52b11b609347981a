"""Copy-on-write snapshots (ucp/saving/cow/snapshot.py, ucp/saving/cow/helper.py): save returns at once, the checkpoint holds the
state of the call whatever writes it next, and a failing helper fails the save without blocking training."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from ucp_helpers import assert_same_state, random_tensor, same_bytes  # noqa: E402

import ucp  # noqa: E402
from ucp.saving.async_save import AsyncSaver  # noqa: E402
from ucp.saving.cow import snapshot as ucp_cow  # noqa: E402

needs_cow = pytest.mark.skipif(
    ucp_cow.cow_unavailable() is not None, reason=f"copy-on-write snapshots unavailable: {ucp_cow.cow_unavailable()}"
)


def state_of(seed: int = 0) -> dict:
    cplx = random_tensor(torch.complex64, (8, 8), seed + 1)
    return {
        "big": random_tensor(torch.float32, (2048, 1024), seed),  # 8 MiB: four helper blocks
        "bf": random_tensor(torch.bfloat16, (333,), seed + 2),
        "f8": random_tensor(torch.float8_e4m3fn, (17, 3), seed + 3),
        "b": random_tensor(torch.bool, (9,), seed + 4),
        "i": random_tensor(torch.int32, (5000,), seed + 5),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "strided": random_tensor(torch.float64, (64, 48), seed + 6).t(),  # copied before returning
        "conj": cplx.conj(),  # copied before returning (its memory is not its value)
        "step": 3,
    }


def clone(state: dict) -> dict:
    return {k: v.detach().clone().resolve_conj() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def write_everything(state: dict, path: Path) -> None:
    """Every way training (or anything else) writes tensor memory, right after save returned."""
    big = state["big"]
    big.data.mul_(-3)  # through .data: torch's version counter does not see it
    big.numpy()[-1, -1] = 123.0  # numpy, last page (the last block the helper would copy)
    memoryview(state["i"].numpy()).cast("B")[:4] = b"\xff\xff\xff\xff"  # a Python-level write, GIL held
    with open(path, "rb") as f:  # the kernel writes (read(2) into the tensor)
        os.readv(f.fileno(), [memoryview(state["i"].numpy()).cast("B")[100:200]])
    state["bf"].add_(1)
    state["f8"].view(torch.uint8).bitwise_not_()
    state["b"].logical_not_()
    state["scalar"].fill_(-1)
    state["strided"].zero_()
    state["conj"].mul_(0)
    done = threading.Event()

    def write() -> None:
        state["big"].add_(1)
        done.set()

    threading.Thread(target=write).start()  # another thread
    assert done.wait(60), "a write from another thread never finished"


@needs_cow
def test_writes_of_every_kind_after_save_leave_the_checkpoint_as_called(tmp_path):
    noise = tmp_path / "noise.bin"
    noise.write_bytes(os.urandom(4096))
    state = state_of()
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        assert saver.snapshot == "cow"
        saver._cow.pause_before_copy = 0.5  # the helper copies late: every write below faults first
        handle = saver.save(state, tmp_path / "ck", step=5)
        assert handle.snapshot_done()  # nothing to wait for: the state may change at once
        write_everything(state, noise)
        assert handle.result(timeout=120).step == 5
        assert saver._cow.faulted_blocks > 0  # the writes were caught and copied first
    assert not torch.equal(state["big"], expected["big"])
    assert_same_state(expected, ucp.load(tmp_path / "ck"))
    assert ucp.verify(tmp_path / "ck").ok


@needs_cow
def test_repeated_saves_reuse_the_helper_and_the_staging(tmp_path):
    state = state_of(1)
    with AsyncSaver(snapshot="cow") as saver:
        for step in range(4):
            expected = clone(state)
            handle = saver.save(state, tmp_path / f"s{step}", step=step)
            state["big"].add_(1)
            state["i"].mul_(3)
            handle.result(timeout=120)
            assert_same_state(expected, ucp.load(tmp_path / f"s{step}"))
        assert saver.pool.created == 1
        pid = saver._cow._proc.pid
    assert saver._cow._proc.returncode is not None  # close() stopped the helper
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@needs_cow
def test_tensors_in_file_mappings_are_copied_before_returning(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(1 << 18, dtype=np.float32).tobytes())
    mapped = torch.from_file(str(path), shared=True, size=1 << 18, dtype=torch.float32)  # write protection refuses it
    state = {"mapped": mapped, "plain": random_tensor(torch.float32, (1 << 16,), 3)}
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        handle = saver.save(state, tmp_path / "ck")
        mapped.add_(1)
        state["plain"].add_(1)
        handle.result(timeout=120)
    assert_same_state(expected, ucp.load(tmp_path / "ck"))


@needs_cow
def test_two_saves_in_flight_over_the_same_tensors(tmp_path):
    state = state_of(2)
    first = clone(state)
    with AsyncSaver(snapshot="cow", max_in_flight=2) as saver:
        saver._cow.pause_before_copy = 0.3
        h1 = saver.save(state, tmp_path / "a")
        state["big"].add_(1)
        second = clone(state)
        h2 = saver.save(state, tmp_path / "b")  # the first still protects these pages: copied now instead
        state["big"].add_(1)
        state["i"].zero_()
        h1.result(timeout=120)
        h2.result(timeout=120)
    assert_same_state(first, ucp.load(tmp_path / "a"))
    assert_same_state(second, ucp.load(tmp_path / "b"))


@needs_cow
def test_a_killed_helper_fails_the_save_releases_the_writers_and_the_next_save_copies(tmp_path):
    state = state_of(4)
    before = clone(state)
    ucp.save(state, tmp_path / "ck", step=1)
    with AsyncSaver(snapshot="cow") as saver:
        saver._cow.pause_before_copy = 30.0  # the helper would hold every page for 30 s
        handle = saver.save(state, tmp_path / "ck", step=2)
        os.kill(saver._cow._proc.pid, signal.SIGKILL)
        done = threading.Event()
        threading.Thread(target=lambda: (state["big"].add_(1), done.set()), daemon=True).start()
        assert done.wait(20), "a write to a protected page stayed blocked after the helper died"
        with pytest.raises(ucp.CheckpointError, match="copy-on-write helper"):
            handle.result(timeout=60)
        # the previous checkpoint is intact, no temporary directory is left
        assert_same_state(before, ucp.load(tmp_path / "ck"))
        assert sorted(os.listdir(tmp_path)) == ["ck"]
        # later saves copy before returning, and are exact
        expected = clone(state)
        handle = saver.save(state, tmp_path / "ck", step=3)
        state["big"].zero_()
        assert handle.result(timeout=120).step == 3
    assert_same_state(expected, ucp.load(tmp_path / "ck"))


def test_auto_copies_before_returning_where_copy_on_write_is_not_possible(tmp_path, monkeypatch):
    monkeypatch.setenv("UCP_COW", "0")
    with AsyncSaver() as saver:
        assert saver.snapshot == "sync"
        state = state_of(5)
        expected = clone(state)
        handle = saver.save(state, tmp_path / "ck")
        state["big"].zero_()
        handle.result(timeout=120)
    assert_same_state(expected, ucp.load(tmp_path / "ck"))
    with pytest.raises(ucp_cow.CowUnavailable, match="UCP_COW=0"):
        AsyncSaver(snapshot="cow")
    monkeypatch.delenv("UCP_COW")
    with pytest.raises(ValueError, match="mode='thread'"):
        AsyncSaver(mode="process", snapshot="cow")
    with AsyncSaver(mode="process") as saver:
        assert saver.snapshot == "sync"  # the writer process must survive this one: it copies first


@needs_cow
def test_a_fork_during_the_copy_neither_blocks_the_child_nor_changes_the_checkpoint(tmp_path):
    """Data-loader workers fork while a snapshot is being copied: the child's pages are not protected."""
    state = state_of(6)
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        saver._cow.pause_before_copy = 0.5
        handle = saver.save(state, tmp_path / "ck")
        pid = os.fork()
        if pid == 0:  # the child writes its copy of the tensors and exits at once
            try:  # through numpy: torch's OpenMP pool, used by the parent, hangs in a forked child
                child_view = state["big"].numpy()
                child_view.fill(5)
                os._exit(0 if float(child_view[0, 0]) == 5.0 else 3)
            except BaseException:
                os._exit(4)
        state["big"].zero_()  # the parent's write waits for the helper, as usual
        assert os.waitpid(pid, 0)[1] == 0
        handle.result(timeout=120)
    assert_same_state(expected, ucp.load(tmp_path / "ck"))


@needs_cow
def test_loading_into_the_tensors_right_after_saving_them(tmp_path):
    """The kernel writes (O_DIRECT reads into the tensors' memory) wait for the copy as user writes do."""
    other = state_of(7)
    ucp.save(other, tmp_path / "other")
    state = state_of(8)
    expected = clone(state)
    with AsyncSaver(snapshot="cow") as saver:
        saver._cow.pause_before_copy = 0.3
        handle = saver.save(state, tmp_path / "ck")
        ucp.load(tmp_path / "other", into=state)
        handle.result(timeout=120)
        assert saver._cow.faulted_blocks > 0
    assert_same_state(expected, ucp.load(tmp_path / "ck"))
    assert same_bytes(state["big"], other["big"]) and same_bytes(state["i"], other["i"])


@needs_cow
def test_a_state_that_grows_gets_a_new_arena_and_stays_exact(tmp_path):
    with AsyncSaver(snapshot="cow") as saver:
        for i, rows in enumerate((256, 4096, 256)):
            state = {"w": random_tensor(torch.float32, (rows, 1024), i), "i": random_tensor(torch.int64, (99,), i)}
            expected = clone(state)
            handle = saver.save(state, tmp_path / f"ck{i}")
            state["w"].add_(1)
            handle.result(timeout=120)
            assert_same_state(expected, ucp.load(tmp_path / f"ck{i}"))
        assert saver.pool.created == 2  # the small arena was dropped (the helper unmapped it) for a larger one


@needs_cow
def test_prepare_starts_the_helper_which_maps_the_staging_ahead(tmp_path):
    state = state_of(9)
    with AsyncSaver(snapshot="cow") as saver:
        assert saver._cow._proc is None  # nothing started yet
        reserved = saver.prepare(state)
        helper = saver._cow._proc.pid
        for _ in range(200):  # the helper maps it as it reads the message
            with open(f"/proc/{helper}/maps") as f:
                if "memfd:ucp-staging" in f.read():
                    break
            threading.Event().wait(0.05)
        else:
            pytest.fail("the helper did not map the prepared staging arena")
        expected = clone(state)
        handle = saver.save(state, tmp_path / "ck")
        state["big"].zero_()
        handle.result(timeout=120)
        assert saver.pool.created == 1 and saver._cow._proc.pid == helper and reserved > 0
    assert_same_state(expected, ucp.load(tmp_path / "ck"))


@needs_cow
def test_memory_freed_and_mapped_again_before_its_copy_fails_the_save_naming_the_tensor(tmp_path):
    """The caller's allocator unmaps a saved tensor's memory and something else is mapped at the same
    address before the helper copied it: the save fails naming the tensor, it never commits the new
    occupant's bytes."""
    import ctypes
    import mmap as mm

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    prot, private = mm.PROT_READ | mm.PROT_WRITE, mm.MAP_PRIVATE | mm.MAP_ANONYMOUS
    length = 16 << 20
    address = libc.mmap(None, length, prot, private, -1, 0)  # memory as an allocator maps it
    w = torch.frombuffer((ctypes.c_char * length).from_address(address), dtype=torch.float32)
    w.copy_(random_tensor(torch.float32, (length // 4,), 12))
    try:
        with AsyncSaver(snapshot="cow") as saver:
            saver._cow.pause_before_copy = 0.5
            handle = saver.save({"w": w}, tmp_path / "ck")
            assert libc.munmap(address, length) == 0  # returns once the helper has read the unmap event
            again = libc.mmap(address, length, prot, private | 0x100000, -1, 0)  # MAP_FIXED_NOREPLACE
            assert again == address, "could not map the freed range again"
            ctypes.memset(address, 0x7F, length)  # the new occupant's bytes
            with pytest.raises(ucp.CheckpointError, match=r"tensor 'w': its memory was freed or moved"):
                handle.result(timeout=120)
        assert not (tmp_path / "ck").exists()
    finally:
        libc.munmap(address, length)


@needs_cow
def test_a_save_that_gets_no_userfaultfd_copies_and_the_next_one_protects_again(tmp_path, monkeypatch):
    import errno

    state = state_of(13)
    with AsyncSaver(snapshot="cow") as saver:
        saver.prepare(state)
        real = ucp_cow.WriteProtector.create

        def refused() -> ucp_cow.WriteProtector:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(ucp_cow.WriteProtector, "create", staticmethod(refused))
        expected = clone(state)
        handle = saver.save(state, tmp_path / "a")
        state["big"].add_(1)  # copied before save returned: no protection needed
        handle.result(timeout=120)
        assert_same_state(expected, ucp.load(tmp_path / "a"))
        monkeypatch.setattr(ucp_cow.WriteProtector, "create", real)
        saver._cow.pause_before_copy = 0.3
        expected = clone(state)
        handle = saver.save(state, tmp_path / "b")
        state["big"].add_(1)
        handle.result(timeout=120)
        assert saver._cow.faulted_blocks > 0  # protected again
    assert_same_state(expected, ucp.load(tmp_path / "b"))
