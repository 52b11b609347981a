"""Fixtures for the kernels tests: run a test under a forced backend and restore the process' choice."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import torch
from torch.utils import cpp_extension

from kernels import _build


@pytest.fixture
def torch_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The pure-torch fallback, as on a machine without a compiler (``UCP_KERNELS=torch``)."""
    monkeypatch.setenv("UCP_KERNELS", "torch")
    _build.reset()
    yield
    monkeypatch.delenv("UCP_KERNELS")
    _build.reset()


@pytest.fixture
def cpp_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The C++ extension (built once into the cache); a failed build fails the test. Skipped where no
    compiler or ninja exists (the package then runs, and is tested, on its pure-torch fallback)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or not cpp_extension.is_ninja_available():
        pytest.skip(f"no C++ toolchain here ({compiler!r} or ninja missing): the C++ kernels cannot be built")
    monkeypatch.setenv("UCP_KERNELS", "cpp")
    _build.reset()
    yield
    monkeypatch.delenv("UCP_KERNELS")
    _build.reset()


@pytest.fixture
def threads() -> Iterator[None]:
    """Restore torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
