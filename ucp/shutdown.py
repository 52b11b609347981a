"""Ending a process whose work is done without the interpreter's teardown.

After the last command of a program has returned, Python still tears down every module. With
torch loaded that takes ~0.4 s, and on this project's CPU machines a multi-process run sometimes
aborts in it ("terminate called without an active exception" from a C++ thread of gloo's being
destroyed at exit, about one torchrun in five here): the work was done, yet the process exits
with SIGABRT. :func:`exit_now` does what a normal exit does that matters — join non-daemon threads
(which lets ``concurrent.futures`` and ``ucp.async_save`` finish work in flight), run exit
handlers, flush Python's output — and then ends the process.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_now(code: int | str | None = 0) -> None:
    """End the process with ``code`` (as ``sys.exit`` would interpret it), skipping module teardown."""
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with the descriptor closed
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code is None:
        code = 0
    elif not isinstance(code, int):  # as Python does: sys.exit("message") prints it and exits 1
        print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code)
