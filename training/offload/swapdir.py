"""The run's own swap directory: fresh, named for its owner, removed when the run ends.

A run never looks at what else is in ``nvme_path``: its state lives only in a directory it made
itself (``ucp-swap-<what>-r<rank>-p<pid>-<random>``, with an ``OWNER.json`` saying who), so a stale
directory left by a killed run is never read as state, and removing the run's own cannot touch
anything else. The directory goes at :meth:`SwapDir.remove`, when the object is collected, and at
interpreter exit (``weakref.finalize``: ``ucp.shutdown.exit_now`` runs exit handlers too).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
import weakref
from pathlib import Path

from .errors import OffloadError

MIN_ALIGNMENT = 4096


class SwapDir:
    """A fresh directory inside ``base`` for ``rank``'s swap files (``what``: ``optimizer`` or ``param``).

    ``key``: the config key that named ``base``, for error messages. Raises :class:`OffloadError` naming
    ``base`` when it is missing, not a directory, or not writable.
    """

    def __init__(self, base: str | os.PathLike[str], *, rank: int, what: str, key: str) -> None:
        self.base = Path(base)
        if not self.base.exists():
            raise OffloadError(f"{key} {str(self.base)!r} does not exist (give an existing directory on the device)")
        if not self.base.is_dir():
            raise OffloadError(f"{key} {str(self.base)!r} is not a directory")
        prefix = f"ucp-swap-{what}-r{rank}-p{os.getpid()}-"
        try:
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.base))
        except OSError as exc:
            raise OffloadError(
                f"{key} {str(self.base)!r}: cannot create the run's swap directory there ({exc.strerror})"
            ) from exc
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "rank": rank, "created": time.time(), "what": what}
        try:
            (self.path / "OWNER.json").write_text(json.dumps(owner))
        except OSError as exc:
            self.remove()
            raise OffloadError(
                f"{key} {str(self.base)!r}: cannot write into the swap directory ({exc.strerror})"
            ) from exc
        self.alignment = io_alignment(self.path)

    def file(self, name: str) -> Path:
        return self.path / name

    def remove(self) -> None:
        """Delete the directory and everything in it (idempotent)."""
        self._finalizer()

    @property
    def removed(self) -> bool:
        return not self._finalizer.alive


def logical_block_size(path: str | os.PathLike[str]) -> int | None:
    """The logical block size of the block device holding ``path`` (sysfs), or None where there is none
    (tmpfs, overlay and network file systems) or sysfs cannot say."""
    st = os.stat(path)
    dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for candidate in (f"{dev}/queue/logical_block_size", f"{dev}/../queue/logical_block_size"):  # disk, partition
        try:
            return int(Path(candidate).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def io_alignment(path: str | os.PathLike[str]) -> int:
    """O_DIRECT alignment for files under ``path``: the device's logical block size, at least 4096 bytes
    (DeepSpeed aligns to a fixed 512 B, which a 4Kn device refuses)."""
    size = logical_block_size(path) or MIN_ALIGNMENT
    return max(MIN_ALIGNMENT, size)
