"""``ucp.save_state`` / ``ucp.load_state``: model, optimizer and LR scheduler in one call, DCP-style.

Built on ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` / ``set_state_dict``), as
DCP users do by hand: the model's state dict (DTensors under FSDP2 / tensor parallelism, plain
tensors otherwise) and the optimizer's keyed by parameter name instead of by index, so that a
checkpoint loads into another sharding, another world size, another wrapping of the same model.

Loading into a *fresh* optimizer needs no ``into`` built by hand: ``get_state_dict`` first gives
the optimizer its state (a step with zero gradients and zero learning rate, as DCP does), which
``ucp.load`` then fills in place — moments and step counts — before ``set_state_dict`` hands it
back to the optimizer. LR schedulers are plain values and go through their own
``state_dict`` / ``load_state_dict``.

The checkpoint is an ordinary UCP checkpoint with top-level keys ``model``, ``optimizer``,
``scheduler`` (those given) and the caller's ``extra`` keys; ``ucp.load(path)`` reads it whole.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Literal, Union, overload

import torch

from ucp.errors import UnsupportedStateError
from ucp.format.manifest import Manifest
from ucp.loading.loader import LoadReport, load
from ucp.saving.sync_save import save

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]
Schedulers = Any  # an LRScheduler (anything with state_dict/load_state_dict), or a list of them

SECTIONS = ("model", "optimizer", "scheduler")


def _optimizers(optimizer: Optimizers | None) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return tuple(optimizer)


def _schedulers_state(scheduler: Schedulers) -> Any:
    if isinstance(scheduler, (list, tuple)):
        return [s.state_dict() for s in scheduler]
    return scheduler.state_dict()


def _load_schedulers(scheduler: Schedulers, state: Any) -> None:
    if isinstance(scheduler, (list, tuple)):
        for s, st in zip(scheduler, state):
            s.load_state_dict(st)
    else:
        scheduler.load_state_dict(state)


def _check_extra(extra: dict[str, Any] | None) -> None:
    """``extra`` keys must not replace a section (``save_state`` and ``load_state`` share this check)."""
    for key in extra or {}:
        if key in SECTIONS:
            raise UnsupportedStateError(f"extra key {key!r} would replace the {key} section: pick another name")


def get_state(
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    scheduler: Schedulers | None = None,
    *,
    options: Any = None,
) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ..., "scheduler": ...}`` (the parts given) as ``save_state`` writes
    them and ``load_state`` fills them: ``torch.distributed.checkpoint.state_dict.get_state_dict`` for
    the model and optimizers (a fresh optimizer gets its state initialised first, so that a load can
    fill it), the schedulers' ``state_dict()``. ``options``: a ``StateDictOptions``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    optims = _optimizers(optimizer)
    state: dict[str, Any] = {}
    if optims:
        state["model"], state["optimizer"] = get_state_dict(model, optims, options=options)
    else:
        state["model"] = get_model_state_dict(model, options=options)
    if scheduler is not None:
        state["scheduler"] = _schedulers_state(scheduler)
    return state


def set_state(
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    scheduler: Schedulers | None = None,
    *,
    state: dict[str, Any],
    options: Any = None,
) -> None:
    """Give ``state`` (what :func:`get_state` returned, filled by a load) back to the model, optimizers
    and schedulers (``set_state_dict``, ``load_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    optims = _optimizers(optimizer)
    if optims:
        set_state_dict(
            model, optims, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
        )
    else:
        set_model_state_dict(model, state["model"], options=options)
    if scheduler is not None:
        _load_schedulers(scheduler, state["scheduler"])


def save_state(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    scheduler: Schedulers | None = None,
    extra: dict[str, Any] | None = None,
    options: Any = None,
    **save_kwargs: Any,
) -> Manifest:
    """Save the model, optimizer(s) and scheduler(s) at ``path`` with ``ucp.save`` (every rank calls it).

    ``extra``: more top-level entries (a step counter, data loader state...); its keys must not be
    ``model``, ``optimizer`` or ``scheduler``. ``save_kwargs`` go to ``ucp.save`` (``step``,
    ``metadata``, ``process_group``, ...). Returns the manifest.
    """
    state = get_state(model, optimizer, scheduler, options=options)
    _check_extra(extra)
    state.update(extra or {})
    return save(state, path, **save_kwargs)


@overload
def load_state(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    scheduler: Schedulers | None = None,
    extra: dict[str, Any] | None = None,
    strict: Literal[True] = True,
    options: Any = None,
    **load_kwargs: Any,
) -> dict[str, Any]: ...


@overload
def load_state(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    scheduler: Schedulers | None = None,
    extra: dict[str, Any] | None = None,
    strict: Literal[False],
    options: Any = None,
    **load_kwargs: Any,
) -> LoadReport: ...


def load_state(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: Optimizers | None = None,
    scheduler: Schedulers | None = None,
    extra: dict[str, Any] | None = None,
    strict: bool = True,
    options: Any = None,
    **load_kwargs: Any,
) -> dict[str, Any] | LoadReport:
    """Resume the model, optimizer(s) and scheduler(s) from the checkpoint at ``path`` (every rank calls it).

    Works into any sharding (FSDP2, tensor parallel, another world size, plain modules) and into a
    fresh optimizer: each rank reads only the bytes of its own shards. ``extra``: more top-level
    entries to fill (as ``ucp.load(into=)`` does: plain values replaced, tensors filled in place).
    ``strict`` (default): the checkpoint's keys of these sections must match the model's and
    optimizer's exactly (one error naming all differences, before anything is read); ``strict=False``
    loads what matches and returns the ``LoadReport``. ``load_kwargs`` go to ``ucp.load`` (``verify``,
    ``process_group``, ...). Returns the filled state (``{"model": ..., ..., **extra}``).
    """
    _check_extra(extra)
    state = get_state(model, optimizer, scheduler, options=options)
    state.update(extra or {})
    result: dict[str, Any] | LoadReport = (
        load(path, into=state, **load_kwargs) if strict else load(path, into=state, strict=False, **load_kwargs)
    )
    set_state(model, optimizer, scheduler, state=state, options=options)
    return result
