"""Real DeepSpeed checkpoints for tests, built on demand (once per machine: tools/peers caches them).

Tests used to look for checkpoints under $UCP_PEER_CACHE and skip when a fresh machine had none yet;
these helpers build what a test asks for instead, and skip only where DeepSpeed is not installed.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tools.peers.deepspeed_ckpt import deepspeed_missing, make_checkpoint, reference_universal

# (zero stage, dtype, world): every stage, both dtypes and both world sizes; the same checkpoints the
# DeepSpeed import tests use, so a run builds each once.
CI_CONFIGS: list[tuple[int, str, int]] = [(1, "bf16", 2), (2, "fp32", 2), (3, "fp32", 2), (3, "bf16", 4)]
DEFAULT_WORLD = {(1, "bf16"): 2, (2, "fp32"): 2, (3, "fp32"): 2, (3, "bf16"): 4}


def config_id(config: tuple[int, str, int]) -> str:
    stage, dtype, world = config
    return f"z{stage}-{dtype}-w{world}"


@functools.cache
def _build(stage: int, dtype: str, world: int) -> Path:
    return make_checkpoint(world_size=world, zero_stage=stage, dtype=dtype, steps=3)  # type: ignore[arg-type]


def deepspeed_checkpoint(stage: int, dtype: str, world: int | None = None) -> Path:
    """The root of a 3-step DeepSpeed checkpoint of the tiny GPT (built, or taken from the peer cache).

    ``world`` defaults to the world size of that stage and dtype in CI_CONFIGS (2 unless listed)."""
    missing = deepspeed_missing()
    if missing is not None:
        pytest.skip(missing)
    return _build(stage, dtype, world if world is not None else DEFAULT_WORLD.get((stage, dtype), 2))


@functools.cache
def deepspeed_universal(stage: int, dtype: str, world: int | None = None) -> Path:
    """ds_to_universal's conversion of :func:`deepspeed_checkpoint` (made once, kept beside it)."""
    return reference_universal(deepspeed_checkpoint(stage, dtype, world))
