"""A ``ucp`` process's imports, made cheaper: the cyclic GC paused while they load, what they loaded frozen.

A one-shot command (``ucp verify``, ``reshape``, ``convert``, ``export``) spends most of its time outside
its data movement importing ~400 modules (typer, rich, pydantic, the command's own), whose objects live
until the process ends. The cyclic GC, triggered every 700 allocations, would walk them again and again
(3-4 % of such a command's instructions); so :func:`imports` pauses it for a block of imports and then
freezes what is there (``gc.freeze``: left out of every later collection) before turning it back on.

Only in a process the ``ucp`` entry point owns (:func:`own_process`, called by :func:`ucp.cli.main.main`):
a command run in-process (a test's ``CliRunner``) leaves the GC of its host alone, since frozen objects
in a reference cycle are never freed.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

from ucp.cli.timings import phase

_owned = False


def own_process() -> None:
    """Say that this process is a ``ucp`` command's own (it ends when the command does)."""
    global _owned
    _owned = True


@contextmanager
def paused_gc() -> Iterator[None]:
    """Run the block with the cyclic GC paused, then freeze the objects alive and resume it; a no-op unless
    :func:`own_process` was called, or when the GC is off already (nested, or turned off by the user)."""
    if not _owned or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


@contextmanager
def imports() -> Iterator[None]:
    """A command's own imports: timed as ``imports`` (:mod:`ucp.cli.timings`), with :func:`paused_gc`."""
    with phase("imports"), paused_gc():
        yield
