"""The KvikIO path: file <-> GPU memory through ``kvikio.CuFile``.

With cuFile/GDS the NVMe DMA engine moves bytes straight into GPU memory and
host memory is never touched; in KvikIO's compatibility mode KvikIO does the
bouncing itself. Either way this module only hands KvikIO a device pointer
(a flat uint8 CUDA tensor, via ``__cuda_array_interface__``) and checks the
byte counts, because KvikIO reports a short read as a smaller count, not an
error.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import torch

from aio import AioError, open_file
from aio.files import sync_file


class KvikioPath:
    """Reads and writes CUDA tensors with KvikIO (imported lazily, on first use)."""

    def __init__(self) -> None:
        import kvikio  # GdsHandle checked it imports

        self._kvikio: Any = kvikio

    def write(self, path: str | os.PathLike[str], src: torch.Tensor, *, fsync: bool) -> int:
        """Write the flat uint8 CUDA tensor ``src`` as the whole file ``path``."""
        path = os.fspath(path)
        nbytes = src.numel()
        with torch.cuda.device(src.device):
            # KvikIO reads device memory outside torch's stream order; let the
            # kernels that produce ``src`` finish first.
            torch.cuda.current_stream(src.device).synchronize()
            try:
                with self._kvikio.CuFile(path, "w") as f:
                    done = f.write(src) if nbytes else 0
            except Exception as exc:
                _remove(path)
                raise AioError(errno.EIO, path, 0, f"kvikio write of {nbytes} bytes failed: {exc}") from exc
        if done != nbytes:
            _remove(path)
            raise AioError(errno.EIO, path, done, f"kvikio wrote {done} of {nbytes} bytes")
        if fsync:
            with open_file(path, "r", direct=False) as f:
                sync_file(f)
        return nbytes

    def read_into(self, path: str | os.PathLike[str], dst: torch.Tensor, offset: int) -> int:
        """Fill the flat uint8 CUDA tensor ``dst`` from ``path`` at ``offset``."""
        path = os.fspath(path)
        nbytes = dst.numel()
        if nbytes == 0:
            return 0
        with torch.cuda.device(dst.device):
            # Earlier work on the caller's stream may still be using ``dst``.
            torch.cuda.current_stream(dst.device).synchronize()
            try:
                with self._kvikio.CuFile(path, "r") as f:
                    done = f.read(dst, nbytes, offset)
            except Exception as exc:
                raise AioError(errno.EIO, path, offset, f"kvikio read of {nbytes} bytes failed: {exc}") from exc
        if done != nbytes:
            raise AioError(errno.ENODATA, path, offset + done, f"kvikio read {done} of {nbytes} bytes")
        return nbytes


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
