"""The options of asynchronous saves, in one model: every default is written here and nowhere else.

:class:`ucp.saving.async_save.AsyncSaver` and :class:`ucp.CheckpointManager` take the same options as
keyword arguments (a keyword left out, or None, means the default below) and build this model from
them; the background job (:class:`ucp.saving.background.job.WriteJob`) takes its ``commit_timeout``
default from here too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from aio import AioConfig
from ucp.store.storage import as_aio_config

Mode = Literal["thread", "process"]
Snapshot = Literal["auto", "cow", "sync", "background", "none"]
MODES: tuple[str, ...] = ("thread", "process")
SNAPSHOTS: tuple[str, ...] = ("auto", "cow", "sync", "background", "none")


class AsyncSaveOptions(BaseModel):
    """How an :class:`~ucp.saving.async_save.AsyncSaver` saves; see its docstring for what each option does.

    ``max_in_flight``: snapshots held at once. ``mode``: where the writer runs. ``aio_config``: the I/O
    settings of the writes (an AioConfig or a DeepSpeed-style ``aio`` dict; None: the storage's default). ``staging_dir``: where ``mode="process"``
    keeps its shared staging memory. ``commit_timeout``: seconds the ranks wait for each other at the
    commit. ``pipeline``: write while the snapshot is still copying. ``snapshot``: how the state is
    captured ("auto" picks "cow" or "sync"). ``hold_optimizer_steps``: deferred snapshots hold
    ``torch.optim`` steps until they have read the tensors.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_in_flight: int = 1
    mode: Mode = "thread"
    aio_config: AioConfig | None = None
    staging_dir: str = "/dev/shm"
    commit_timeout: float = 1800.0
    pipeline: bool = False
    snapshot: Snapshot = "auto"
    hold_optimizer_steps: bool = True

    @field_validator("mode", mode="before")
    @classmethod
    def _known_mode(cls, value: Any) -> Any:
        if value not in MODES:
            raise ValueError(f"mode must be 'thread' or 'process', got {value!r}")
        return value

    @field_validator("snapshot", mode="before")
    @classmethod
    def _known_snapshot(cls, value: Any) -> Any:
        if value not in SNAPSHOTS:
            raise ValueError(f"snapshot must be 'auto', 'cow', 'sync', 'background' or 'none', got {value!r}")
        return value

    @field_validator("aio_config", mode="before")
    @classmethod
    def _aio_config(cls, value: Any) -> Any:
        return as_aio_config(value) if isinstance(value, dict) else value  # DeepSpeed-style ``aio`` keys too

    @classmethod
    def build(cls, base: "AsyncSaveOptions | None" = None, **given: Any) -> "AsyncSaveOptions":
        """``base`` (or the defaults) with the keyword arguments that were given (not None) on top."""
        values = {name: getattr(base, name) for name in base.model_fields_set} if base is not None else {}
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)


DEFAULTS = AsyncSaveOptions()
