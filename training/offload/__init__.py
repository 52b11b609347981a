"""ZeRO-Offload / ZeRO-Infinity: optimizer state in host memory or on NVMe, streamed through ``aio``.

* :mod:`.config` — DeepSpeed's ``offload_optimizer`` / ``offload_param`` / ``sub_group_size`` / ``aio``
  keys, parsed so that a DeepSpeed JSON config works unchanged (:meth:`OffloadConfig.from_deepspeed`);
* :mod:`.swapdir` — the run's own, freshly made swap directory and the device's I/O alignment;
* :mod:`.store` — sub-groups and the two tiers: swap files with CRC-32C checks (NVMe) or host memory (CPU);
* :mod:`.optimizer` — the pipelined Adam step over sub-groups that ``training.zero`` calls.

docs/offload.md describes the keys, the defaults that differ from DeepSpeed's and why.
"""

from __future__ import annotations

from .config import OffloadConfig, OffloadOptimizerConfig, OffloadParamConfig
from .errors import OffloadError
from .optimizer import OptimizerOffload

__all__ = ["OffloadConfig", "OffloadError", "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerOffload"]
