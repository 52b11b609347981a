"""The ways of moving N GiB to disk and back that ``ucp bench io`` compares.

Every method writes one file from the same source bytes (filled once, reused)
and reads it back; after each read (outside the timing) every byte is compared
with the source, so the bench never reports the speed of wrong data. torch and
safetensors are imported here lazily: only the bench needs them.
"""

from __future__ import annotations

import abc
import os
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from aio import AioConfig, AioHandle, AlignedBuffer
from aio.tune import describe, first_mismatch, poison
from ucp.bench.raw import Dd, Fio, RawRun

if TYPE_CHECKING:
    import torch

MethodKind = Literal["raw", "ucp", "torch", "safetensors"]


def fsync_path(path: str) -> None:
    """fsync a file written by a library that does not fsync (torch.save, safetensors)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def touch_pages(tensor: "torch.Tensor") -> None:
    """Read one byte of every page of a CPU tensor (forces a lazily mapped file in)."""
    import mmap

    import torch

    flat = tensor.reshape(-1).view(torch.uint8).numpy()
    int(flat[:: mmap.PAGESIZE].sum(dtype=np.uint64))


class Method(abc.ABC):
    """One way to write and read a file. ``write``/``read`` return what an external tool
    measured itself, or ``None`` when the caller's clock and rusage are the measurement."""

    name: str
    label: str
    kind: MethodKind
    verifies = True

    def __init__(self, source: AlignedBuffer) -> None:
        self.source = source

    @property
    @abc.abstractmethod
    def detail(self) -> str:
        """How the method is configured, for the report."""

    @abc.abstractmethod
    def write(self, path: str) -> RawRun | None: ...

    def prepare_read(self) -> None:  # noqa: B027 - an optional hook: a no-op by default, not abstract
        """Get ready for the next read and its check (every byte is checked). Nothing to do for a
        method whose read returns new memory."""

    @abc.abstractmethod
    def read(self, path: str) -> RawRun | None: ...

    def loaded_bytes(self) -> np.ndarray | None:
        """The bytes the last ``read`` produced, as a flat uint8 array (None: nothing to check)."""
        return None

    def check(self) -> int | None:
        """Offset of the first byte the last read got wrong, else ``None``; compares every byte."""
        got = self.loaded_bytes()
        if got is None:
            return None
        return first_mismatch(self.source.numpy(), got)

    def release(self) -> None:  # noqa: B027 - an optional hook: a no-op by default, not abstract
        """Drop what ``read`` loaded, before the next method runs."""

    def close(self) -> None:  # noqa: B027 - an optional hook: a no-op by default, not abstract
        """Release the method's resources at the end of the bench."""


class RawMethod(Method):
    """fio or dd: the device limit. Their data is their own, so nothing is checked."""

    kind: MethodKind = "raw"
    verifies = False

    def __init__(self, source: AlignedBuffer, tool: Fio | Dd) -> None:
        super().__init__(source)
        self.tool = tool
        self.name = self.label = tool.name

    @property
    def detail(self) -> str:
        return self.tool.describe()

    def write(self, path: str) -> RawRun | None:
        return self.tool.write(path)

    def read(self, path: str) -> RawRun | None:
        return self.tool.read(path)


class AioMethod(Method):
    """UCP's aio engine: ``write_file`` (fsync included), ``read_file`` into a reused buffer."""

    kind: MethodKind = "ucp"

    def __init__(self, source: AlignedBuffer, config: AioConfig, out: AlignedBuffer | None = None) -> None:
        super().__init__(source)
        self.config = config
        self.io = AioHandle(config)
        self.name = f"ucp-{self.io.engine_name}"
        self.label = f"ucp aio {self.io.engine_name}"
        # The read target is preallocated once (and may be shared by the engines): a real
        # loader reuses its buffers, and first-touch page faults are not I/O.
        self.out = out if out is not None else AlignedBuffer(source.nbytes, pin=False)

    @property
    def detail(self) -> str:
        return f"AioHandle.write_file/read_file(out=), {describe(self.config.model_copy(update={'engine': self.io.engine_name}))}"

    def write(self, path: str) -> RawRun | None:
        self.io.write_file(path, self.source.view(), fsync=True)
        return None

    def prepare_read(self) -> None:
        poison(self.out.numpy())  # the reused buffer's bytes from the last round must not pass for this read's

    def read(self, path: str) -> RawRun | None:
        self.io.read_file(path, out=self.out)
        return None

    def loaded_bytes(self) -> np.ndarray | None:
        return self.out.numpy()

    def close(self) -> None:
        self.io.close()


class _TensorMethod(Method):
    """Common part of the torch and safetensors methods: one float32 tensor over the source bytes."""

    def __init__(self, source: AlignedBuffer) -> None:
        super().__init__(source)
        import torch

        self.tensor = source.tensor().view(torch.float32)  # zero copy; source size is a multiple of 4
        self.loaded: "torch.Tensor | None" = None

    def loaded_bytes(self) -> np.ndarray | None:
        import torch

        assert self.loaded is not None
        return self.loaded.contiguous().view(torch.uint8).numpy()

    def release(self) -> None:
        self.loaded = None


class TorchMethod(_TensorMethod):
    name = "torch"
    label = "torch save/load"
    kind: MethodKind = "torch"

    @property
    def detail(self) -> str:
        return "torch.save(path) + fsync; torch.load(path, weights_only=True, mmap=False)"

    def write(self, path: str) -> RawRun | None:
        import torch

        torch.save(self.tensor, path)
        fsync_path(path)
        return None

    def read(self, path: str) -> RawRun | None:
        import torch

        self.loaded = torch.load(path, weights_only=True, mmap=False)
        return None


class SafetensorsMethod(_TensorMethod):
    name = "safetensors"
    label = "safetensors"
    kind: MethodKind = "safetensors"

    @property
    def detail(self) -> str:
        return "safetensors.torch.save_file + fsync; load_file + touching every page (its default mmap backend is lazy)"

    def write(self, path: str) -> RawRun | None:
        from safetensors.torch import save_file

        save_file({"data": self.tensor}, path)
        fsync_path(path)
        return None

    def read(self, path: str) -> RawRun | None:
        from safetensors.torch import load_file

        self.loaded = load_file(path)["data"]
        # load_file's default backend maps the file and reads nothing until the bytes are used;
        # fault in every page so that the time covers reading the data, as for the others.
        touch_pages(self.loaded)
        return None


def versions() -> dict[str, Any]:
    """Library versions worth printing next to the numbers."""
    import platform

    out: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("torch", "safetensors"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # pragma: no cover - a broken install should not stop the bench
            out[mod] = None
    return out
