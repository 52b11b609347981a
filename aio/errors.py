"""Errors raised by the I/O core: always naming the file and the offset at fault."""

from __future__ import annotations

import errno as _errno
import os
from typing import Any


class AioError(OSError):
    """An I/O request failed. ``filename`` and ``offset`` say where."""

    def __init__(self, err: int, path: str | os.PathLike[str], offset: int | None = None, what: str = "") -> None:
        self.offset = offset
        self.what = what
        where = f" at offset {offset}" if offset is not None else ""
        detail = f" ({what})" if what else ""
        msg = f"{os.strerror(err)}{where}{detail}"
        super().__init__(err, msg, os.fspath(path))

    def __str__(self) -> str:  # OSError's default puts the filename last, after a colon
        return f"[Errno {self.errno}] {self.strerror}: {self.filename!r}"

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuild from our own constructor's arguments.

        OSError's default hands ``(errno, strerror, filename)`` back to ``__init__``, which takes
        ``(err, path, offset, what)``: pickling (to another process) or ``copy.copy`` would garble it.
        """
        return type(self), (self.errno, self.filename, self.offset, self.what), self.__dict__


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (_errno.ENOSPC, _errno.EDQUOT)
