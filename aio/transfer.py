"""One buffer moved to or from one file range, every request in flight at once and every one waited for.

The shared step under the offload tiers' swap files (training.offload) and a writer process's reads of their
copies (ucp.store.file_ranges): both move a whole aligned record and then decide themselves what a short or
failed transfer means for their caller, so this returns the facts instead of raising.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

from .engines import Engine
from .files import open_file


def transfer(
    engine: Engine, path: str | Path, view: memoryview, *, write: bool, block: int, direct: bool, offset: int = 0
) -> tuple[BaseException | None, bool, int]:
    """Move ``view`` to (``write``) or from the file at ``path``, from byte ``offset``, in requests of at most
    ``block`` bytes all in flight at once through ``engine``, every one waited for (a buffer must not be reused
    while the device may touch it). Returns the first request's error, whether every request moved all its
    bytes (a read past the end of a truncated file comes back short) and the file's size. Raises
    :class:`aio.errors.AioError` when the file cannot be opened."""
    with open_file(path, "r+" if write else "r", direct=direct) as f:
        submit = engine.submit_write if write else engine.submit_read
        futures = [(off, submit(f, offset + off, view[off : off + block])) for off in range(0, view.nbytes, block)]
        error = _wait(futures)
        size = os.fstat(f.fd).st_size
    whole = error is not None or all(fut.result() == min(block, view.nbytes - off) for off, fut in futures)
    return error, whole, size


def _wait(futures: list[tuple[int, Future[int]]]) -> BaseException | None:
    """Wait for every request (a buffer must not be reused while the device may write it); the first error."""
    error: BaseException | None = None
    for _, fut in futures:
        exc = fut.exception()
        if exc is not None and error is None:
            error = exc
    return error


__all__ = ["transfer"]
