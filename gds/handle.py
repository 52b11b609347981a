"""``GdsHandle``: aio's file API, for tensors on any device.

A file written by ``write_tensor`` holds exactly the tensor's bytes (no
header), so it can be read back by either path, by ``aio``, or by ``numpy``.
The handle picks one path for CUDA tensors when it is built (``mode``) and
always uses the staged path for host tensors, where aio is already at home.
"""

from __future__ import annotations

import errno
import operator
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import ValidationError

from aio import AioConfig, AioError, AioHandle

from .capability import CapabilityReport, capabilities
from .staged import DEFAULT_STAGING_BYTES, StagedPath, check_staging_bytes
from .tensors import describe, dest_bytes, source_bytes

ModeRequest = Literal["auto", "kvikio", "staged"]


class GdsHandle:
    """Writes tensors to files and reads files into tensors, GPU-direct where possible.

    ``mode``: ``"auto"`` (KvikIO when a GPU is visible and KvikIO imports, else
    staged; see ``gds.capabilities()`` for why), ``"kvikio"`` (RuntimeError if
    unavailable) or ``"staged"``. ``mode`` attribute: the path in use.
    ``config``: an ``AioConfig``, or a dict read the way ucp reads ``aio_config``
    (AioConfig fields or a DeepSpeed ``aio`` section); None for the defaults.
    """

    def __init__(
        self,
        config: AioConfig | Mapping[str, Any] | None = None,
        mode: ModeRequest = "auto",
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        # Everything that can be refused is checked before the aio engine (a libaio
        # context and its reaper thread) is opened, and the engine is closed if a
        # later step still fails: a failed construction leaves nothing running.
        if mode not in ("auto", "kvikio", "staged"):
            raise ValueError(f"mode must be 'auto', 'kvikio' or 'staged', got {mode!r}")
        self.config = _as_config(config)
        staging_bytes = check_staging_bytes(staging_bytes, self.config.alignment)
        self.capabilities: CapabilityReport = capabilities()
        if mode == "kvikio" and not self.capabilities.kvikio_usable:
            raise RuntimeError(f"mode='kvikio' is not available on this machine: {_missing_pieces(self.capabilities)}")
        self.mode: Literal["kvikio", "staged"] = self.capabilities.auto_mode if mode == "auto" else mode
        self._kvikio = None
        if self.mode == "kvikio":
            from .kvikio_path import KvikioPath

            self._kvikio = KvikioPath()
        self.io = AioHandle(self.config)
        try:
            self._staged = StagedPath(self.io, staging_bytes)
        except BaseException:
            self.io.close()
            raise
        self._closed = False

    # -- API ------------------------------------------------------------------------
    def write_tensor(self, path: str | os.PathLike[str], tensor: torch.Tensor, fsync: bool | None = None) -> int:
        """Write ``tensor``'s raw bytes as the whole content of ``path``; returns the byte count."""
        self._check_open()
        src = source_bytes(tensor, f"the tensor for {os.fspath(path)!r}")
        if self._kvikio is not None and src.is_cuda:
            return self._kvikio.write(path, src, fsync=self.config.fsync if fsync is None else fsync)
        return self._staged.write(path, src, fsync=fsync)

    def read_into_tensor(self, path: str | os.PathLike[str], tensor: torch.Tensor, offset: int = 0) -> int:
        """Fill the preallocated contiguous ``tensor`` with the bytes of ``path`` from ``offset``."""
        self._check_open()
        dst = dest_bytes(tensor, f"the tensor for {os.fspath(path)!r}")
        offset = _check_offset(path, offset)
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
        device = torch.device(device)
        self._check_device(path, device)
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

    def _check_device(self, path: str | os.PathLike[str], device: torch.device) -> None:
        """Refuse a GPU this process cannot use with gds's reasons, before torch fails on it deep inside."""
        if device.type != "cuda":
            return
        caps = self.capabilities
        if not caps.cuda_available:
            raise RuntimeError(
                f"cannot read {os.fspath(path)!r} into a tensor on {device}: CUDA is not usable in this process "
                f"(gds.capabilities() reports: {_missing_pieces(caps)})"
            )
        if device.index is not None and device.index >= caps.device_count:
            raise RuntimeError(
                f"cannot read {os.fspath(path)!r} into a tensor on {device}: "
                f"this process sees {caps.device_count} GPU(s)"
            )


def _as_config(config: object) -> AioConfig:
    """``config`` as an AioConfig; a dict is read as ucp reads ``aio_config`` (AioConfig.from_deepspeed)."""
    if config is None:
        return AioConfig()
    if isinstance(config, AioConfig):
        return config
    if isinstance(config, Mapping):
        try:
            return AioConfig.from_deepspeed(dict(config))
        except ValidationError as exc:
            raise ValueError(f"config is not a valid aio configuration: {exc}") from exc
    raise TypeError(
        "config must be an AioConfig, a dict (AioConfig fields or a DeepSpeed 'aio' section) or None, "
        f"got {type(config).__name__}"
    )


def _missing_pieces(caps: CapabilityReport) -> str:
    """The capability report's reasons, without its closing "auto uses ..." line."""
    return "; ".join(r for r in caps.reasons if not r.startswith("auto uses"))


def _check_offset(path: str | os.PathLike[str], offset: int) -> int:
    """``offset`` as a non-negative int (numpy integers welcome), or an error naming it and the file."""
    try:
        value = operator.index(offset)
    except TypeError:
        raise TypeError(
            f"offset must be an integer, got {type(offset).__name__} {offset!r} (reading {os.fspath(path)!r})"
        ) from None
    if value < 0:
        raise ValueError(f"offset must be >= 0, got {value} (reading {os.fspath(path)!r})")
    return value


def _check_extent(path: str | os.PathLike[str], offset: int, nbytes: int, tensor: torch.Tensor) -> None:
    """Fail before touching the tensor when the file cannot fill it (naming file, offset and sizes)."""
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
