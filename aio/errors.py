"""Errors raised by the I/O core: always naming the file and the offset at fault."""

from __future__ import annotations

import errno as _errno
import os


class AioError(OSError):
    """An I/O request failed. ``filename`` and ``offset`` say where."""

    def __init__(self, err: int, path: str | os.PathLike[str], offset: int | None = None, what: str = "") -> None:
        self.offset = offset
        where = f" at offset {offset}" if offset is not None else ""
        detail = f" ({what})" if what else ""
        msg = f"{os.strerror(err)}{where}{detail}"
        super().__init__(err, msg, os.fspath(path))

    def __str__(self) -> str:  # OSError's default puts the filename last, after a colon
        return f"[Errno {self.errno}] {self.strerror}: {self.filename!r}"


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (_errno.ENOSPC, _errno.EDQUOT)
