"""What every bench shares, light enough for the CLI to import up front: errors, limits, switches."""

from __future__ import annotations

import os

from ucp.errors import BenchError  # a ucp.CheckpointError, defined with the rest of the hierarchy

# The largest --size-gib any bench accepts: 1 PiB, beyond any disk the bench could fill. A bound
# keeps the size arithmetic finite (``inf`` or 1e300 GiB would overflow it) and the refusal early.
MAX_SIZE_GIB = float(1 << 20)

NO_FIO_ENV = "UCP_BENCH_NO_FIO"  # set to 1 to use the dd fallback even where fio is installed

__all__ = ["MAX_SIZE_GIB", "NO_FIO_ENV", "BenchError", "BenchWarning", "fio_switched_off"]


class BenchWarning(UserWarning):
    """The bench runs, but its numbers may mislead (e.g. more ranks than CPUs)."""


def fio_switched_off() -> bool:
    """Whether ``UCP_BENCH_NO_FIO`` asks for dd: any value but empty, 0, false, no or off."""
    return os.environ.get(NO_FIO_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
