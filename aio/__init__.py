"""aio: async file I/O at device bandwidth (libaio with O_DIRECT, or a thread pool).

Typical use::

    from aio import AioHandle, AioConfig
    with AioHandle(AioConfig(block_size=8 << 20, queue_depth=16)) as io:
        io.write_file("x.bin", tensor.numpy().view("uint8"))
        buf = io.read_file("x.bin")          # page-aligned, reusable AlignedBuffer
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

# Public name -> submodule, resolved on first use (PEP 562): ``import aio.prefetch`` at the start
# of a command stays cheap (no numpy, no engines), so the prefetch starts as early as it can.
_EXPORTS: dict[str, tuple[str, str]] = {
    "AlignedBuffer": ("buffers", "AlignedBuffer"),
    "BufferPool": ("buffers", "BufferPool"),
    "AioConfig": ("config", "AioConfig"),
    "Engine": ("engines", "Engine"),
    "LibaioEngine": ("engines", "LibaioEngine"),
    "ThreadEngine": ("engines", "ThreadEngine"),
    "create_engine": ("engines", "create_engine"),
    "libaio_status": ("engines", "libaio_status"),
    "AioError": ("errors", "AioError"),
    "OpenFile": ("files", "OpenFile"),
    "fsync_dir": ("files", "fsync_dir"),
    "open_file": ("files", "open_file"),
    "AioHandle": ("handle", "AioHandle"),
    "FileWriter": ("handle", "FileWriter"),
    "as_bytes_view": ("handle", "as_bytes_view"),
    "shared_handle": ("handle", "shared_handle"),
    "Prefetch": ("prefetch", "Prefetch"),
    "prefetch_files": ("prefetch", "prefetch_files"),
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


if not TYPE_CHECKING:  # static tools see the imports above; at run time names resolve on first use
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
