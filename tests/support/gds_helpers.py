"""Shared helpers for the gds tests: reproducible tensors with awkward bit patterns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aio import libaio_status


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random *bytes* viewed as ``dtype``: NaN payloads, -0.0, subnormals included.

    bool gets 0/1 only, since other byte values are not valid bools.
    """
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=n, dtype=np.uint8)).to(torch.bool).reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, size=n * itemsize, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's memory as bytes, independent of dtype semantics (NaN != NaN does not matter)."""
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # standard strides, lazy bits resolved
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes()


def engines() -> list:
    ok, why = libaio_status()
    return [
        pytest.param("libaio", marks=pytest.mark.skipif(not ok, reason=f"libaio unavailable: {why}")),
        "threads",
    ]


@pytest.fixture(autouse=True)
def fresh_capability_probe():
    """For test modules that import it: tests there may fake the capability report; never leak it."""
    import gds

    gds.capabilities(refresh=True)
    yield
    gds.capabilities(refresh=True)
