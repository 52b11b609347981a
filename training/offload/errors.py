"""The error of the offload tiers: always naming the directory, file and sub-group at fault."""

from __future__ import annotations


class OffloadError(RuntimeError):
    """A swap tier cannot be set up, or its state cannot be trusted (missing/read-only ``nvme_path``,
    a full device, a swap file truncated or changed under the run)."""
