"""Set-up shared by the offload tests (tests/training/offload/): the GPT engine under an offload config, the
in-memory reference run that saves a checkpoint part way, the optimizer state of a tier (or of memory), a small
tmpfs for full or read-only swap dirs, and the peak-RSS probe of the streamed checkpoint tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import ucp
from training import Engine
from training.models.gpt import GPTConfig
from training.offload import OffloadConfig


def gpt_engine(model: dict[str, Any], options: dict[str, Any], off: dict[str, Any] | None, **extra: Any) -> Engine:
    """A GPT ``model`` Engine with ``options`` (``extra`` on top) under offload config ``off`` (None: none)."""
    config = OffloadConfig.model_validate(off) if off else OffloadConfig()
    return Engine(GPTConfig(**model), offload=config, **{**options, **extra})


def train_saving_at(e: Engine, root: Path, steps: int, split: int) -> tuple[list[float], Path]:
    """Train ``e`` for ``steps`` steps, saving into a CheckpointManager at ``root`` after step ``split``:
    the losses, and that checkpoint's path."""
    losses = []
    for s in range(steps):
        losses.append(e.train_step(s))
        if s + 1 == split:
            e.save(ucp.CheckpointManager(root))
    return losses, Path(ucp.CheckpointManager(root).path(split))


def optimizer_state(e: Engine) -> list[tuple[torch.Tensor, ...]]:
    """Each group's fp32 master, exp_avg and exp_avg_sq of ``e``'s partition: gathered from the offload tier
    (read, checked, left as it was), or the optimizer's own tensors when nothing is offloaded."""
    off = e.optimizer.offload
    if off is None:
        opt = e.optimizer
        return [(opt.master[g], opt.exp_avg[g], opt.exp_avg_sq[g]) for g in range(len(opt.plans))]
    return [off.gather_group(g) for g in range(len(e.optimizer.plans))]


def scribble(path: Path, offset: int, n: int = 16) -> None:
    """Overwrite ``n`` bytes of ``path`` at ``offset`` with 0x7f, durably: the damage a swap file's
    checksums must catch."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x7f" * n, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *options: str) -> Iterator[Path]:
    """A small tmpfs mounted at ``path`` for the test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    path.mkdir()
    opts = ",".join([f"size={size}", *options])
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount refused here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class PeakRss:
    """How far a block raises this process's peak resident set above its resident set when it began
    (Linux: writing 5 to /proc/self/clear_refs resets the peak). ``extra``: bytes, after the block."""

    def __enter__(self) -> PeakRss:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError as exc:
            pytest.skip(f"cannot reset the peak RSS here: {exc}")
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.extra = _status("VmHWM") - self.start


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")
