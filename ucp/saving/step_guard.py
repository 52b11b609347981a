"""Optimizer steps wait for the deferred snapshots that are still reading the tensors.

A deferred snapshot (``AsyncSaver(snapshot="background")`` or ``"none"``) reads the state dict
after ``save`` has returned, so the caller must not change the saved tensors until
``handle.wait_snapshot()``. A training loop changes them in one place, ``optimizer.step()``:
a global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
waits there for every deferred snapshot still running. A loop that forgets ``wait_snapshot()``
then still saves exactly the state it asked to save, and one that remembers it loses nothing:
the copy overlaps forward and backward either way.

Only ``torch.optim`` optimizers (and subclasses) run the hook. Other in-place writes to a saved
tensor are caught by the snapshot's version check (the save fails, naming the tensor); writes
through ``.data`` or numpy views are not seen at all (see :class:`ucp.saving.snapshot.ChangeWatch`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from typing import Any

_lock = threading.Lock()
_running: set[Future] = set()
_hook: Any = None  # the registered hook's handle, once a deferred snapshot has started


def hold_steps_until(done: Future) -> None:
    """Make every optimizer step that starts before ``done`` completes wait for it."""
    global _hook
    with _lock:
        if _hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook = register_optimizer_step_pre_hook(_before_step)
        _running.add(done)
    done.add_done_callback(_forget)


def running() -> int:
    """How many deferred snapshots an optimizer step would wait for now."""
    with _lock:
        return len(_running)


def _forget(done: Future) -> None:
    with _lock:
        _running.discard(done)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The hook: wait for every deferred snapshot running now (a failed one is raised by its save, not here)."""
    with _lock:
        waiting = list(_running)
    if waiting:
        wait(waiting)
