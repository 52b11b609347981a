"""An opt-in phase timer for the one-shot commands: ``UCP_TIMINGS=1 ucp reshape ...`` prints where the
process's time went, as one line on stderr just before it exits::

    ucp timings: imports=0.412 setup=0.031 io=0.120 exit=0.004 total=0.567

* ``imports``: from the process's start (the interpreter's own start-up included) until the command
  modules are loaded, plus the imports a command makes itself (``with phase("imports")``);
* ``io``: the library call that moves data (``with phase("io")``: reshape, convert, export, verify);
* ``exit``: from the command's return until the process ends (threads joined, exit handlers run);
* ``setup``: everything else (argument parsing, planning, printing the result).

Why: issue 21 asks these commands to spend at most 0.3 s outside their data movement; this line shows
the split without a profiler (``tools/bench_cli_overhead.py`` reads it). Off by default, and costs
nothing then. Phases do not nest: an inner phase's time is counted once, under the inner phase.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator

ENABLED = os.environ.get("UCP_TIMINGS", "").strip().lower() not in ("", "0", "false", "no", "off")
PHASES = ("imports", "setup", "io", "exit")
PREFIX = "ucp timings:"

_spent: dict[str, float] = dict.fromkeys(PHASES, 0.0)
_open: list[str] = []  # the phase being timed, if any (phases do not nest)
_start = time.perf_counter()  # replaced by the process's start when /proc says it (see process_start)


def process_start() -> float:
    """When this process started, on ``time.perf_counter``'s clock (10 ms resolution; this module's import
    time where ``/proc/self/stat`` is not there)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return _start
    return time.perf_counter() - max(0.0, age)


if ENABLED:
    _start = process_start()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the time spent in the block as ``name`` (one of :data:`PHASES`); a no-op unless enabled or when
    a phase is already being timed (the outer one keeps the time)."""
    if not ENABLED or _open:
        yield
        return
    _open.append(name)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _spent[name] += time.perf_counter() - t0
        _open.pop()


def mark(name: str) -> None:
    """Count everything since the process started that no phase has counted yet as ``name`` (the start-up
    imports, once the command modules are loaded)."""
    if ENABLED:
        _spent[name] += time.perf_counter() - _start - sum(_spent.values())


def line(exit_started: float) -> str:
    """The report: ``exit`` is the time since ``exit_started``; ``setup`` what no phase counted."""
    total = time.perf_counter() - _start
    spent = dict(_spent, exit=time.perf_counter() - exit_started)
    spent["setup"] = max(0.0, total - sum(v for k, v in spent.items() if k != "setup"))
    return f"{PREFIX} " + " ".join(f"{k}={spent[k]:.3f}" for k in PHASES) + f" total={total:.3f}"


def report(exit_started: float) -> None:
    """Print :func:`line` to stderr when enabled (the last thing before the process ends)."""
    if ENABLED and sys.stderr is not None:
        try:
            print(line(exit_started), file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed: nowhere to say it
            pass
