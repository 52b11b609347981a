"""What the kernel says about memory: /proc/meminfo fields and this process's peak resident set.

Budgets (the prefetch's share of available memory) and reports (peak RSS of a reshape or an
inference run, page-cache growth) read the same files; this module reads them once, one way.
"""

from __future__ import annotations

import resource


def _kib_field(path: str, field: str) -> int | None:
    """``field`` of a ``Name:  N kB`` file such as /proc/meminfo, in bytes; None where it is absent."""
    prefix = field + ":"
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def meminfo(field: str) -> int | None:
    """A /proc/meminfo field (``MemAvailable``, ``Cached``, ...) in bytes, None where there is none."""
    return _kib_field("/proc/meminfo", field)


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes: VmHWM, which starts afresh at exec
    (getrusage's ru_maxrss carries the parent's peak across fork + exec, so a child of a big process
    would report its parent's); ru_maxrss only where /proc is absent."""
    hwm = _kib_field("/proc/self/status", "VmHWM")
    return hwm if hwm is not None else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
