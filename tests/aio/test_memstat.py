"""aio.memstat: /proc/meminfo fields and the process's peak resident set."""

from __future__ import annotations

import subprocess
import sys

from aio.memstat import meminfo, peak_rss


def test_meminfo_reads_fields_in_bytes() -> None:
    total, available = meminfo("MemTotal"), meminfo("MemAvailable")
    assert total is not None and available is not None
    assert 0 < available <= total and total % 1024 == 0
    assert meminfo("NoSuchField") is None


def test_peak_rss_follows_this_process_not_its_parent() -> None:
    code = (
        "from aio.memstat import peak_rss\n"
        "before = peak_rss()\n"
        "block = bytearray(64 << 20)\n"
        "block[::4096] = b'x' * len(block[::4096])\n"  # touch every page
        "after = peak_rss()\n"
        "assert after - before >= 60 << 20, (before, after)\n"
        "print(before)\n"
    )
    hog = bytearray(256 << 20)  # this process's peak rises well past a fresh interpreter's
    hog[::4096] = b"y" * len(hog[::4096])
    child_start = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert child_start < peak_rss() - (200 << 20)  # VmHWM starts afresh at exec
