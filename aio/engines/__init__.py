"""Engine backends and the choice between them."""

from __future__ import annotations

import logging
from typing import Literal

from aio.config import AioConfig

from .base import Engine
from .libaio_engine import LIBAIO_ERROR, LibaioEngine
from .threads import ThreadEngine

log = logging.getLogger(__name__)

__all__ = ["Engine", "LibaioEngine", "ThreadEngine", "create_engine", "libaio_status", "set_auto_engine"]

_auto_engine: Literal["libaio", "threads"] | None = None  # set_auto_engine's choice; None: prefer libaio


def set_auto_engine(name: Literal["libaio", "threads"] | None) -> None:
    """What ``engine="auto"`` builds from now on in this process: ``"threads"`` the thread engine; None (the
    default) or ``"libaio"`` libaio where it works, else threads.

    For a process that knows its whole job, e.g. a one-shot command moving a few MiB: a kernel AIO
    context costs its process ~35 ms when destroyed (an RCU grace period, waited for by ``io_destroy``
    and by the process's exit alike; measured on the reference VM), longer than the thread engine takes
    to move such data. Engines built before keep theirs (``aio.shared_handle`` caches one per config).
    """
    global _auto_engine
    _auto_engine = name


def libaio_status() -> tuple[bool, str]:
    """Whether kernel AIO works here, and why not when it does not."""
    if LIBAIO_ERROR is not None:
        return False, f"PyPI libaio or libaio.so.1 missing ({LIBAIO_ERROR}); install Debian's libaio1"
    try:
        LibaioEngine(queue_depth=1).close()
    except Exception as exc:  # io_setup can fail in locked-down containers
        return False, f"io_setup failed: {exc}"
    return True, "libaio available"


def create_engine(config: AioConfig) -> Engine:
    """Build the engine ``config.engine`` names; ``auto`` prefers libaio and logs why it did not."""
    if config.engine == "threads" or (config.engine == "auto" and _auto_engine == "threads"):
        return ThreadEngine(config.thread_count)
    if config.engine == "libaio":
        return LibaioEngine(config.queue_depth, single_submit=config.single_submit)
    ok, why = libaio_status()
    if ok:
        log.debug("engine=auto chose libaio")
        return LibaioEngine(config.queue_depth, single_submit=config.single_submit)
    log.info("engine=auto chose threads: %s", why)
    return ThreadEngine(config.thread_count)
