"""The options of asynchronous saves, in one model: every default is written here and nowhere else.

:class:`ucp.saving.async_save.AsyncSaver` and :class:`ucp.CheckpointManager` take the same options as
keyword arguments (a keyword left out, or None, means the default below) and build this model from
them; the background job (:class:`ucp.saving.background.job.WriteJob`) takes its ``commit_timeout``
default from here too.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from aio import AioConfig
from ucp.store.storage import as_aio_config

Mode = Literal["thread", "process"]
Snapshot = Literal["auto", "cow", "sync", "background", "none"]
CHOICES: dict[str, tuple[str, ...]] = {"mode": get_args(Mode), "snapshot": get_args(Snapshot)}


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

    @field_validator("mode", "snapshot", mode="before")
    @classmethod
    def _known_choice(cls, value: Any, info: ValidationInfo) -> Any:
        """One of the field's values (its Literal), else an error naming the field and listing them."""
        names = CHOICES[info.field_name or ""]
        if value not in names:
            listed = ", ".join(map(repr, names[:-1])) + f" or {names[-1]!r}"
            raise ValueError(f"{info.field_name} must be {listed}, got {value!r}")
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
