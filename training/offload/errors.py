"""The error of the offload tiers: always naming the directory, file and sub-group at fault."""

from __future__ import annotations

from aio.errors import is_no_space


class OffloadError(RuntimeError):
    """A swap tier cannot be set up, or its state cannot be trusted (missing/read-only ``nvme_path``,
    a full device, a swap file truncated or changed under the run)."""


def os_reason(exc: OSError) -> str:
    """Why a copy or write of a tier's bytes failed, in words: a full device said plainly, else the OS's message."""
    return "the device is full" if is_no_space(exc) else exc.strerror or str(exc)
