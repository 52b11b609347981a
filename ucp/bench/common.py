"""What every bench shares, light enough for the CLI to import up front: errors, limits, switches."""

from __future__ import annotations

import os

from ucp.errors import BenchError  # a ucp.CheckpointError, defined with the rest of the hierarchy

# The largest --size-gib any bench accepts: 1 PiB, beyond any disk the bench could fill. A bound
# keeps the size arithmetic finite (``inf`` or 1e300 GiB would overflow it) and the refusal early.
MAX_SIZE_GIB = float(1 << 20)

NO_FIO_ENV = "UCP_BENCH_NO_FIO"  # set to 1 to use the dd fallback even where fio is installed

__all__ = ["MAX_SIZE_GIB", "NO_FIO_ENV", "BenchError", "BenchWarning", "evict", "fio_switched_off"]


class BenchWarning(UserWarning):
    """The bench runs, but its numbers may mislead (e.g. more ranks than CPUs)."""


def fio_switched_off() -> bool:
    """Whether ``UCP_BENCH_NO_FIO`` asks for dd: any value but empty, 0, false, no or off."""
    return os.environ.get(NO_FIO_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _fs_type(path: str) -> str | None:
    """The file system type of the mount holding ``path`` (from /proc/self/mounts), None if unknown."""
    real, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind


def evict(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """Make the next read of ``path`` (a file, or every file under a directory) come from the device
    without touching the rest of the page cache: each file is fsynced, then its pages are evicted
    (``posix_fadvise(DONTNEED)``, no root needed). (whether every file was evicted, a note saying how)."""
    from aio.tune import evict_file

    root = os.fspath(path)
    fs = _fs_type(root)
    if fs in ("tmpfs", "ramfs"):
        return False, f"the bench's files are on {fs} (memory): reads cannot be cold there"
    files = [root] if os.path.isfile(root) else [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
    ok = True
    for name in files:
        try:
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not evicted
            finally:
                os.close(fd)
        except OSError:
            ok = False
            continue
        ok = evict_file(name) and ok
    if ok:
        return True, "the bench's files evicted from the page cache before every read (--drop-caches drops it all)"
    return False, "posix_fadvise(DONTNEED) refused for some files here; try --drop-caches (needs root)"
