"""Bad input to the NVMe offload tier: a clear OffloadError naming the path, file and sub-group, never
silent garbage — a missing, non-directory or read-only nvme_path, a full device, a swap file truncated
or changed under the run, a pool budget too small for one sub-group; a stale swap directory is never read."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from offload_helpers import scribble, tmpfs
from offload_worker import weights_digest

import ucp
from aio.errors import AioError
from training import Engine
from training.offload import OffloadConfig, OffloadError

SUB_GROUP = 65536  # elements: 768 KiB records; the tiny GPT's 0.85M parameters make 13 sub-groups (10 MiB)
STEPS = 2


def config(path: Path | str, **extra: Any) -> OffloadConfig:
    return OffloadConfig.model_validate(
        {"offload_optimizer": {"device": "nvme", "nvme_path": str(path)}, "sub_group_size": SUB_GROUP, **extra}
    )


def engine(off: OffloadConfig | None = None) -> Engine:
    return Engine("tiny", zero_stage=1, weight_decay=0.1, offload=off or OffloadConfig())


def swap_files(e: Engine) -> list[Path]:
    assert e.optimizer.offload is not None
    return sorted(Path(e.optimizer.offload.describe()["dir"]).glob("subgroup-*.swp"))


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], str]:
    e = engine()
    losses = [e.train_step(s) for s in range(STEPS)]
    return losses, weights_digest(e)


def test_missing_nvme_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(OffloadError, match=rf"offload_optimizer.nvme_path '{missing}' does not exist"):
        engine(config(missing))


def test_nvme_path_that_is_a_file_is_named(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OffloadError, match=rf"offload_optimizer.nvme_path '{f}' is not a directory"):
        engine(config(f))


def test_read_only_nvme_path_is_named(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        with pytest.raises(OffloadError, match=rf"'{ro}': cannot create the run's swap directory there \(Read-only"):
            engine(config(ro))


def test_a_device_too_small_fails_at_start_up_naming_file_and_sub_group(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "4m") as small:
        with pytest.raises(OffloadError) as info:
            engine(config(small))
        msg = str(info.value)
        assert "the device is full" in msg and f"{small}/ucp-swap-optimizer-r0-" in msg
        assert "subgroup-" in msg and "sub-group " in msg and "(group " in msg
        assert list(small.iterdir()) == []  # the half-made swap directory is gone


def test_space_is_reserved_so_filling_the_device_later_does_not_stop_the_run(
    tmp_path: Path, reference: tuple[list[float], str]
) -> None:
    with tmpfs(tmp_path / "fits", "16m") as fits:
        e = engine(config(fits))
        try:
            filler = fits / "filler"
            with pytest.raises(OSError) as full, open(filler, "wb") as f:
                while True:  # another process fills the device after start-up
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            assert full.value.errno == errno.ENOSPC
            losses = [e.train_step(s) for s in range(STEPS)]
            assert (losses, weights_digest(e)) == reference
        finally:
            e.close()


def test_enospc_in_a_write_back_mid_run_names_file_and_sub_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: tuple[list[float], str]
) -> None:
    (tmp_path / "swap").mkdir()
    e = engine(config(tmp_path / "swap"))
    manager = ucp.CheckpointManager(tmp_path / "ckpt")
    try:
        e.train_step(0)
        e.save(manager)
        store = e.optimizer.offload.store
        real = store._engine.submit_write
        target = swap_files(e)[5]

        def submit_write(f: Any, offset: int, buf: memoryview, future: Future | None = None) -> Future:
            if f.path == str(target):  # a device (thin-provisioned, copy-on-write) that runs out of space now
                fut: Future = Future()
                fut.set_exception(AioError(errno.ENOSPC, f.path, offset, "write"))
                return fut
            return real(f, offset, buf, future)

        monkeypatch.setattr(store._engine, "submit_write", submit_write)
        with pytest.raises(OffloadError, match=rf"writing swap file {target} of sub-group 5 .*the device is full"):
            e.train_step(1)  # raised by this step, or (a write-back left running behind it) by the next one
            e.train_step(2)
        monkeypatch.undo()  # space again; but the step stopped half way: the tier is partly updated
        with pytest.raises(OffloadError, match=r"an earlier optimizer step failed half way \(OffloadError: writing"):
            e.train_step(1)
        with pytest.raises(OffloadError, match=r"partly updated and cannot be read as a whole"):
            e.save(manager, step=2)
        assert e.load(manager) == 1  # a load rewrites the whole tier: training goes on as if nothing happened
        assert [e.train_step(1)] == reference[0][1:2]
    finally:
        e.close()


def test_truncated_swap_file_names_file_and_sub_group(tmp_path: Path) -> None:
    e = engine(config(tmp_path))
    try:
        e.train_step(0)
        victim = swap_files(e)[9]
        os.truncate(victim, victim.stat().st_size // 2)
        with pytest.raises(OffloadError, match=rf"swap file {victim} of sub-group 9 \(group \d+, .*is truncated"):
            e.train_step(1)
    finally:
        e.close()


def test_deleted_swap_file_names_file_and_sub_group(tmp_path: Path) -> None:
    e = engine(config(tmp_path))
    try:
        e.train_step(0)
        victim = swap_files(e)[8]
        victim.unlink()
        with pytest.raises(OffloadError, match=rf"reading swap file {victim} of sub-group 8 .*No such file"):
            e.train_step(1)
    finally:
        e.close()


def test_corrupted_swap_file_names_file_and_sub_group(tmp_path: Path) -> None:
    e = engine(config(tmp_path))
    try:
        e.train_step(0)
        victim = swap_files(e)[10]
        scribble(victim, 8192)
        with pytest.raises(OffloadError, match=rf"swap file {victim} of sub-group 10 .*is corrupt: CRC-32C"):
            e.train_step(1)
    finally:
        e.close()


def test_a_stale_swap_directory_is_never_read(tmp_path: Path, reference: tuple[list[float], str]) -> None:
    stale = tmp_path / f"ucp-swap-optimizer-r0-p{os.getpid()}-stale"  # as a killed run of this pid would leave
    stale.mkdir()
    garbage = os.urandom(1 << 20)
    for i in range(20):
        (stale / f"subgroup-{i:05d}-g{i % 2}.swp").write_bytes(garbage)
    e = engine(config(tmp_path))
    try:
        assert Path(e.optimizer.offload.describe()["dir"]) != stale
        losses = [e.train_step(s) for s in range(STEPS)]
        assert (losses, weights_digest(e)) == reference
    finally:
        e.close()
    assert sorted(tmp_path.iterdir()) == [stale]  # ours is gone, the stale one untouched
    assert all(f.read_bytes() == garbage for f in stale.iterdir())


def test_a_budget_below_one_sub_group_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OffloadError, match=r"swap_budget 512 KiB holds not one sub-group's state \(768 KiB"):
        engine(config(tmp_path, swap_budget="512KiB"))
    assert list(tmp_path.iterdir()) == []


def test_the_swap_directory_goes_at_exit_without_close(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from training import Engine\n"
        "from training.offload import OffloadConfig\n"
        "off = OffloadConfig.model_validate({'offload_optimizer': {'device': 'nvme', 'nvme_path': sys.argv[1]}})\n"
        "e = Engine('tiny', offload=off)\n"
        "e.train_step(0)\n"
        "print(e.optimizer.offload.describe()['dir'])\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    made = Path(done.stdout.strip().splitlines()[-1])
    assert made.parent == tmp_path and made.name.startswith("ucp-swap-optimizer-r0-p")
    assert not made.exists() and list(tmp_path.iterdir()) == []
