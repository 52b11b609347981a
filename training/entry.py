"""``training.initialize`` (this module: training.entry): DeepSpeed's entry point for any ``nn.Module``, on UCP's ZeRO and checkpoints.

``deepspeed.initialize(model=m, config=cfg)`` returns ``(engine, optimizer, dataloader, lr_scheduler)``;
this returns the engine alone (``engine.optimizer`` is the optimizer): there is no dataloader or
scheduler object to hand back (the learning rate is ``lr_scheduler(step)``, a function). See
docs/deepspeed-config.md.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

import ucp

from .comm import Comm
from .ds_config import DeepSpeedConfig
from .module_engine import ModuleEngine


def initialize(
    model: nn.Module,
    config: dict[str, Any] | str | os.PathLike[str] | None = None,
    *,
    config_params: dict[str, Any] | None = None,
    model_parameters: Iterable[Any] | None = None,
    lr_scheduler: Callable[[int], float] | None = None,
    swap_budget: int | str | None = None,
    saver: ucp.AsyncSaver | None = None,
) -> ModuleEngine:
    """Wrap ``model`` in a :class:`ModuleEngine` configured by a DeepSpeed config (a dict or a JSON file).

    Runs on the torch.distributed world as it is (torchrun; ranks are data-parallel), or on one process;
    a torchrun world (``WORLD_SIZE`` > 1) not yet initialised is initialised here (gloo on CPU, nccl
    with CUDA), as ``deepspeed.initialize`` does. ``model_parameters``: DeepSpeed's argument; only
    the model's own trainable parameters are accepted (one group). ``swap_budget``: UCP's byte budget
    of the NVMe offload tier's buffer pool. ``saver``: UCP's :class:`ucp.AsyncSaver` for decoupled checkpoints
    (the config's ``checkpoint.writer.decoupled``; e.g. ``ucp.AsyncSaver(mode="process", max_in_flight=2)``);
    default: the engine's own, thread mode, one save in flight.
    Every rank starts from rank 0's weights.
    """
    if config is not None and config_params is not None:
        raise TypeError("give config or config_params, not both")
    source = config if config is not None else config_params
    if source is None:
        raise TypeError("initialize() needs a DeepSpeed config (config=dict or path)")
    _init_distributed()
    world = Comm.world()
    overrides = {} if swap_budget is None else {"swap_budget": swap_budget}
    cfg = DeepSpeedConfig.load(source, world_size=world.size, **overrides)
    if model_parameters is not None:
        _check_parameters(model, model_parameters)
    return ModuleEngine(model, cfg, lr_scheduler=lr_scheduler, dp=world, saver=saver)


def _init_distributed() -> None:
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def _check_parameters(model: nn.Module, given: Iterable[Any]) -> None:
    params = list(given)
    if any(isinstance(p, dict) for p in params):
        raise ValueError(
            "model_parameters: parameter groups (dicts) are not supported; every parameter of the model "
            "is trained with the config's optimizer params"
        )
    own = {id(p) for p in model.parameters() if p.requires_grad}
    ids = {id(p) for p in params}
    if ids != own:
        raise ValueError(
            f"model_parameters: {len(ids)} tensors given, the model has {len(own)} trainable parameters; "
            "only the model's own parameters, all of them, are supported"
        )
