"""The device's own limit, measured by tools outside Python: fio, or dd when fio is missing.

Both use O_DIRECT so the page cache is out of the way, and both write then read
one file sequentially, like a checkpoint. fio keeps ``iodepth`` requests of the
engine's block size in flight (what UCP's libaio engine does), so it is the
number to compare against; dd has one request in flight and is only a fallback.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

from ucp.errors import RawToolError  # a BenchError, defined with the rest of the hierarchy

RawTool = Literal["fio", "dd"]


def fio_available() -> bool:
    return shutil.which("fio") is not None


def direct_io_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files under ``directory`` can be opened with O_DIRECT (tmpfs says no)."""
    probe = os.path.join(os.fspath(directory), ".ucp-direct-probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        return False
    else:
        os.close(fd)
        return True
    finally:
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass


PAGE = 4096  # O_DIRECT requests are whole pages


def whole_block(size: int, block_size: int) -> int:
    """fio's and dd's request size: the largest block dividing both ``size`` (they move whole
    blocks only) and ``block_size`` (so it tiles UCP's engine requests), i.e. their gcd.

    For power-of-two block sizes that is the largest power-of-two fraction of the block that
    divides the size; for others (12 KiB, 3 MiB) a multiple of 4096 no larger than the block.
    """
    bs = math.gcd(size, block_size)
    if size <= 0 or bs % PAGE:
        raise ValueError(
            f"fio/dd move whole pages: the size ({size}) and the block size ({block_size}) must each "
            f"be a positive multiple of {PAGE}"
        )
    return bs


@dataclass
class RawRun:
    """One fio/dd run: what the tool measured itself (None: use the caller's clock and rusage)."""

    seconds: float | None
    cpu_s: float | None
    command: list[str]


class Fio:
    """Sequential write / read of one file with fio's libaio engine."""

    name: RawTool = "fio"

    def __init__(
        self, size: int, block_size: int, queue_depth: int, *, direct: bool = True, iomem: str = "malloc"
    ) -> None:
        self.size = size
        self.block_size = whole_block(size, block_size)
        self.queue_depth = queue_depth
        self.direct = direct
        # fio's buffer memory. On VMs whose virtio disk takes few segments per request, 4 KiB
        # pages scattered in physical memory cap fio's request size (and throughput); "shmhuge"
        # (huge pages, after `echo N > /proc/sys/vm/nr_hugepages`) removes that handicap.
        self.iomem = iomem

    def _command(self, path: str, rw: str) -> list[str]:
        cmd = [
            "fio",
            f"--name=ucp-bench-{rw}",
            f"--filename={path}",
            f"--rw={rw}",
            "--ioengine=libaio",
            f"--direct={int(self.direct)}",
            f"--bs={self.block_size}",
            f"--iodepth={self.queue_depth}",
            f"--size={self.size}",
            "--numjobs=1",
            "--output-format=json",
        ]
        if self.iomem != "malloc":
            cmd.append(f"--iomem={self.iomem}")
        if rw == "write":
            cmd.append("--end_fsync=1")
        return cmd

    def describe(self) -> str:
        return " ".join(self._command("FILE", "write|read")[1:])

    def write(self, path: str) -> RawRun:
        return self._run(path, "write")

    def read(self, path: str) -> RawRun:
        return self._run(path, "read")

    def _run(self, path: str, rw: str) -> RawRun:
        cmd = self._command(path, rw)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RawToolError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        report = json.loads(proc.stdout[proc.stdout.index("{") :])  # fio may print notes before the JSON
        job = report["jobs"][0]
        moved, bw = int(job[rw]["io_bytes"]), float(job[rw]["bw_bytes"])
        if moved != self.size or bw <= 0:
            raise RawToolError(f"{' '.join(cmd)} moved {moved} of {self.size} bytes")
        # CPU of the job itself (fio reports percentages of the job's runtime); fio's start-up
        # (allocating and filling its buffers) is left out, as the bench leaves out UCP's set-up.
        cpu_s = (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100 * float(job["job_runtime"]) / 1000
        return RawRun(moved / bw, cpu_s, cmd)


class Dd:
    """Sequential write / read with GNU dd: one request in flight, O_DIRECT, fsync at the end."""

    name: RawTool = "dd"

    def __init__(self, size: int, block_size: int, *, direct: bool = True) -> None:
        self.size = size
        self.block_size = whole_block(size, block_size)
        self.direct = direct

    def describe(self) -> str:
        flag = "oflag=direct " if self.direct else ""
        return (
            f"dd if=/dev/zero of=FILE bs={self.block_size} count={self.size // self.block_size} {flag}conv=fsync; "
            + (f"dd if=FILE of=/dev/null bs={self.block_size}" + (" iflag=direct" if self.direct else ""))
        )

    def write(self, path: str) -> RawRun:
        cmd = [
            "dd",
            "if=/dev/zero",
            f"of={path}",
            f"bs={self.block_size}",
            f"count={self.size // self.block_size}",
            "conv=fsync",
            "status=none",
        ]
        if self.direct:
            cmd.append("oflag=direct")
        return self._run(cmd)

    def read(self, path: str) -> RawRun:
        cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={self.block_size}", "status=none"]
        if self.direct:
            cmd.append("iflag=direct")
        return self._run(cmd)

    @staticmethod
    def _run(cmd: list[str]) -> RawRun:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RawToolError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return RawRun(None, None, cmd)
