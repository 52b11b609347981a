"""aio: async file I/O at device bandwidth (libaio with O_DIRECT, or a thread pool).

Typical use::

    from aio import AioHandle, AioConfig
    with AioHandle(AioConfig(block_size=8 << 20, queue_depth=16)) as io:
        io.write_file("x.bin", tensor.numpy().view("uint8"))
        buf = io.read_file("x.bin")          # page-aligned, reusable AlignedBuffer
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> submodule, resolved on first use (PEP 562): ``import aio.prefetch`` at the start
# of a command stays cheap (no numpy, no engines), so the prefetch starts as early as it can.
_EXPORTS: dict[str, str] = {
    "AlignedBuffer": "buffers",
    "BufferPool": "buffers",
    "AioConfig": "config",
    "Engine": "engines",
    "LibaioEngine": "engines",
    "ThreadEngine": "engines",
    "create_engine": "engines",
    "libaio_status": "engines",
    "AioError": "errors",
    "OpenFile": "files",
    "fsync_dir": "files",
    "open_file": "files",
    "AioHandle": "handle",
    "FileWriter": "handle",
    "as_bytes_view": "handle",
    "shared_handle": "handle",
    "Prefetch": "prefetch",
    "prefetch_files": "prefetch",
}

if TYPE_CHECKING:
    from .buffers import AlignedBuffer, BufferPool
    from .config import AioConfig
    from .engines import Engine, LibaioEngine, ThreadEngine, create_engine, libaio_status
    from .errors import AioError
    from .files import OpenFile, fsync_dir, open_file
    from .handle import AioHandle, FileWriter, as_bytes_view, shared_handle
    from .prefetch import Prefetch, prefetch_files

__all__ = [
    "AioConfig",
    "AioError",
    "AioHandle",
    "AlignedBuffer",
    "BufferPool",
    "Engine",
    "FileWriter",
    "LibaioEngine",
    "OpenFile",
    "Prefetch",
    "ThreadEngine",
    "as_bytes_view",
    "create_engine",
    "fsync_dir",
    "libaio_status",
    "open_file",
    "prefetch_files",
    "shared_handle",
]


if not TYPE_CHECKING:  # static tools see the imports above; at run time names resolve here

    def __getattr__(name: str) -> Any:
        if name not in _EXPORTS:
            raise AttributeError(f"module 'aio' has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(_EXPORTS))
