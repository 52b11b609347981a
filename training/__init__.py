"""UCP's training runtime: ZeRO data parallelism, tensor and pipeline parallelism for the reference GPT.

* ``training.models``   — the reference GPT and its deterministic data (the single-process truth);
* ``training.layout``   — reshard layouts for the GPT (or any module): who holds what;
* ``training.mesh``     — process groups of a (tp, pp, dp) mesh; ``training.comm`` — a group wrapper;
* ``training.zero``     — ZeRO stages 0-3 with Adam/AdamW over flat fp32 partitions;
* ``training.parallel`` — tensor-parallel layers, the TP/PP GPT stage, the pipeline schedule;
* ``training.checkpoint`` — every rank's state as ucp pieces of the global tensors (the seam);
* ``training.compat``   — does a checkpoint fit an engine (model tensors and config, data seed)?
* ``training.engine``   — ``Engine``: one call per optimizer step; ``python -m training.run``: the CLI.
* ``training.saving``   — how either engine's save reads offloaded state, and its asynchronous saves in flight;
* ``training.entry``  — ``initialize``: DeepSpeed's entry point for any module: ``initialize(model, config=ds_config)``
  returns a ``ModuleEngine`` (``training.module_engine``; config: ``training.ds_config``).

Heavy submodules load on first use (``training.Engine``), so ``import training.models`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeepSpeedConfig", "Engine", "EngineConfig", "ModuleEngine", "initialize"]
_HOMES = {
    "Engine": "engine",
    "EngineConfig": "engine",
    "ModuleEngine": "module_engine",
    "DeepSpeedConfig": "ds_config",
    "initialize": "entry",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
