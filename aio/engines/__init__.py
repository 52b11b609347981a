"""Engine backends and the choice between them."""

from __future__ import annotations

import logging

from aio.config import AioConfig

from .base import Engine
from .libaio_engine import LIBAIO_ERROR, LibaioEngine
from .threads import ThreadEngine

log = logging.getLogger(__name__)

__all__ = ["Engine", "LibaioEngine", "ThreadEngine", "create_engine", "libaio_status"]


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
    if config.engine == "threads":
        return ThreadEngine(config.thread_count)
    if config.engine == "libaio":
        return LibaioEngine(config.queue_depth, single_submit=config.single_submit)
    ok, why = libaio_status()
    if ok:
        log.debug("engine=auto chose libaio")
        return LibaioEngine(config.queue_depth, single_submit=config.single_submit)
    log.info("engine=auto chose threads: %s", why)
    return ThreadEngine(config.thread_count)
