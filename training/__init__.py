"""UCP's training runtime: ZeRO data parallelism, tensor and pipeline parallelism for the reference GPT.

* ``training.models``   — the reference GPT and its deterministic data (the single-process truth);
* ``training.layout``   — reshard layouts for the GPT (or any module): who holds what;
* ``training.mesh``     — process groups of a (tp, pp, dp) mesh; ``training.comm`` — a group wrapper;
* ``training.zero``     — ZeRO stages 0-3 with Adam/AdamW over flat fp32 partitions;
* ``training.parallel`` — tensor-parallel layers, the TP/PP GPT stage, the pipeline schedule;
* ``training.checkpoint`` — every rank's state as ucp pieces of the global tensors (the seam);
* ``training.compat``   — does a checkpoint fit an engine (model tensors and config, data seed)?
* ``training.engine``   — ``Engine``: one call per optimizer step; ``python -m training.run``: the CLI.

Heavy submodules load on first use (``training.Engine``), so ``import training.models`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
