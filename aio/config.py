"""Configuration of the async I/O engines.

The model accepts DeepSpeed's ``aio`` config section unchanged (``block_size``,
``queue_depth``, ``intra_op_parallelism`` / ``thread_count``, ``single_submit``,
``overlap_events``, ``use_gds``) so a DeepSpeed user's JSON works as it is; read through
:meth:`AioConfig.from_deepspeed`, it also means what it means to DeepSpeed (DeepSpeed's defaults).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

EngineName = Literal["auto", "libaio", "threads"]

# A handle stages through up to ``queue_depth + 2`` blocks, each faulted in whole when made: a block
# beyond 1 GiB is a mistake (a unit slip) that would otherwise only fail, or exhaust memory, at first use.
MAX_BLOCK_SIZE = 1 * GIB

# What DeepSpeed (0.19.8, deepspeed/runtime/swap_tensor/constants.py) runs with for a key its ``aio``
# section leaves out. Where these differ from AioConfig's own defaults, from_deepspeed uses these.
DEEPSPEED_AIO_DEFAULTS: dict[str, Any] = {
    "block_size": 1 * MIB,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
    "use_gds": False,
}

# Keys DeepSpeed's own tools write into an ``aio`` section that DeepSpeed's config parser never reads
# (it reads only the keys above). from_deepspeed drops them, as DeepSpeed does, rather than refusing them.
DEEPSPEED_IGNORED_AIO_KEYS: dict[str, str] = {
    "num_threads": "written by ds_nvme_tune (nvme/perf_generate_param.py); DeepSpeed reads intra_op_parallelism",
}

log = logging.getLogger(__name__)


class AioConfig(BaseModel):
    """How bytes move between host memory and files."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    engine: EngineName = "auto"
    block_size: int = Field(8 * MIB, description="bytes per request; a multiple of `alignment`, at most 1 GiB")
    queue_depth: int = Field(32, ge=1, le=4096, description="requests in flight per file stream")
    thread_count: int = Field(
        4,
        ge=1,
        le=256,
        validation_alias=AliasChoices("thread_count", "intra_op_parallelism"),
        description="worker threads of the `threads` engine",
    )
    single_submit: bool = Field(False, description="libaio: submit requests one by one")
    overlap_events: bool = Field(True, description="libaio: reap completions while submitting")
    use_direct: bool = Field(True, description="open files with O_DIRECT where the file system allows")
    alignment: int = Field(4096, description="O_DIRECT alignment of offsets, lengths and buffers")
    fsync: bool = Field(True, description="fdatasync written files before reporting success")
    use_gds: bool = Field(False, description="accepted for DeepSpeed compatibility; see `gds`")

    @field_validator("alignment")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 512 or v & (v - 1):
            raise ValueError(f"alignment must be a power of two >= 512, got {v}")
        return v

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v: int) -> int:
        if v < 4096 or v % 4096:
            raise ValueError(f"block_size must be a positive multiple of 4096, got {v}")
        if v > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE} (1 GiB), got {v}")
        return v

    @model_validator(mode="after")
    def _block_size_aligned(self) -> "AioConfig":
        # A block smaller than the alignment would make the zero-copy write path spin forever.
        if self.block_size % self.alignment:
            raise ValueError(f"block_size ({self.block_size}) must be a multiple of alignment ({self.alignment})")
        return self

    @classmethod
    def from_deepspeed(cls, section: dict[str, Any]) -> "AioConfig":
        """Build from a DeepSpeed ``aio`` section (or a whole DeepSpeed config holding one).

        The result is what DeepSpeed would run: a key the section leaves out takes DeepSpeed's
        default (:data:`DEEPSPEED_AIO_DEFAULTS`), not AioConfig's, so ``from_deepspeed(x).to_deepspeed()``
        means what ``x`` means to DeepSpeed. Keys DeepSpeed's tools write but DeepSpeed ignores are
        dropped; any other unknown key is still refused (a typo must not pass silently).
        """
        if "aio" in section and isinstance(section["aio"], dict):
            section = section["aio"]
        given: dict[str, Any] = {}
        for key, value in section.items():
            if key in DEEPSPEED_IGNORED_AIO_KEYS:
                log.debug(
                    "aio config: ignoring %r=%r, as DeepSpeed does (%s)", key, value, DEEPSPEED_IGNORED_AIO_KEYS[key]
                )
            else:
                given[key] = value
        defaults = dict(DEEPSPEED_AIO_DEFAULTS)
        if "thread_count" in given:  # UCP's name of intra_op_parallelism (older DeepSpeed's too)
            del defaults["intra_op_parallelism"]
        return cls.model_validate({**defaults, **given})

    def to_deepspeed(self) -> dict[str, Any]:
        """The DeepSpeed ``aio`` section equivalent to this configuration."""
        return {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "intra_op_parallelism": self.thread_count,
            "single_submit": self.single_submit,
            "overlap_events": self.overlap_events,
            "use_gds": self.use_gds,
        }
