"""``GdsHandle``: aio's file API, for tensors on any device.

A file written by ``write_tensor`` holds exactly the tensor's bytes (no
header), so it can be read back by either path, by ``aio``, or by ``numpy``.
The handle picks one path for CUDA tensors when it is built (``mode``) and
always uses the staged path for host tensors, where aio is already at home.
"""

from __future__ import annotations

import errno
import os
from typing import Literal

import torch

from aio import AioConfig, AioError, AioHandle

from .capability import CapabilityReport, capabilities
from .staged import DEFAULT_STAGING_BYTES, StagedPath
from .tensors import describe, dest_bytes, source_bytes

ModeRequest = Literal["auto", "kvikio", "staged"]


class GdsHandle:
    """Writes tensors to files and reads files into tensors, GPU-direct where possible.

    ``mode``: ``"auto"`` (KvikIO when a GPU is visible and KvikIO imports, else
    staged; see ``gds.capabilities()`` for why), ``"kvikio"`` (RuntimeError if
    unavailable) or ``"staged"``. ``mode`` attribute: the path in use.
    """

    def __init__(
        self,
        config: AioConfig | None = None,
        mode: ModeRequest = "auto",
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        if mode not in ("auto", "kvikio", "staged"):
            raise ValueError(f"mode must be 'auto', 'kvikio' or 'staged', got {mode!r}")
        self.capabilities: CapabilityReport = capabilities()
        if mode == "kvikio" and not self.capabilities.kvikio_usable:
            why = "; ".join(r for r in self.capabilities.reasons if not r.startswith("auto uses"))
            raise RuntimeError(f"mode='kvikio' is not available on this machine: {why}")
        self.mode: Literal["kvikio", "staged"] = self.capabilities.auto_mode if mode == "auto" else mode
        self.config = config or AioConfig()
        self.io = AioHandle(self.config)
        self._staged = StagedPath(self.io, staging_bytes)
        self._kvikio = None
        if self.mode == "kvikio":
            from .kvikio_path import KvikioPath

            self._kvikio = KvikioPath()
        self._closed = False

    # -- API ------------------------------------------------------------------------
    def write_tensor(self, path: str | os.PathLike[str], tensor: torch.Tensor, fsync: bool | None = None) -> int:
        """Write ``tensor``'s raw bytes as the whole content of ``path``; returns the byte count."""
        self._check_open()
        src = source_bytes(tensor)
        if self._kvikio is not None and src.is_cuda:
            return self._kvikio.write(path, src, fsync=self.config.fsync if fsync is None else fsync)
        return self._staged.write(path, src, fsync=fsync)

    def read_into_tensor(self, path: str | os.PathLike[str], tensor: torch.Tensor, offset: int = 0) -> int:
        """Fill the preallocated contiguous ``tensor`` with the bytes of ``path`` from ``offset``."""
        self._check_open()
        dst = dest_bytes(tensor)
        _check_extent(path, offset, dst.numel(), tensor)
        if self._kvikio is not None and dst.is_cuda:
            return self._kvikio.read_into(path, dst, offset)
        return self._staged.read_into(path, dst, offset)

    def read_tensor(
        self,
        path: str | os.PathLike[str],
        dtype: torch.dtype,
        shape: tuple[int, ...] | list[int] | torch.Size,
        device: torch.device | str = "cpu",
        offset: int = 0,
    ) -> torch.Tensor:
        """A new tensor of ``dtype``/``shape`` on ``device`` holding the bytes of ``path`` from ``offset``."""
        out = torch.empty(tuple(shape), dtype=dtype, device=device)
        self.read_into_tensor(path, out, offset)
        return out

    def close(self) -> None:
        """Release the aio engine and the staging buffers; further calls raise ValueError."""
        if self._closed:
            return
        self._closed = True
        self._staged.close()
        self.io.close()

    def __enter__(self) -> "GdsHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GdsHandle(mode={self.mode!r}, aio_engine={self.io.engine_name!r}, closed={self._closed})"

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("I/O on a closed GdsHandle")


def _check_extent(path: str | os.PathLike[str], offset: int, nbytes: int, tensor: torch.Tensor) -> None:
    """Fail before touching the tensor when the file cannot fill it (naming file, offset and sizes)."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset} (reading {os.fspath(path)!r})")
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise AioError(exc.errno or errno.EIO, path, None, "stat") from exc
    if offset + nbytes > size:
        raise AioError(
            errno.ENODATA,
            path,
            offset,
            f"file has {size} bytes; {describe(tensor)} needs {nbytes} bytes from offset {offset}",
        )
