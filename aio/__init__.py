"""aio: async file I/O at device bandwidth (libaio with O_DIRECT, or a thread pool).

Typical use::

    from aio import AioHandle, AioConfig
    with AioHandle(AioConfig(block_size=8 << 20, queue_depth=16)) as io:
        io.write_file("x.bin", tensor.numpy().view("uint8"))
        buf = io.read_file("x.bin")          # page-aligned, reusable AlignedBuffer
"""

from .buffers import AlignedBuffer, BufferPool
from .config import AioConfig
from .engines import Engine, LibaioEngine, ThreadEngine, create_engine, libaio_status
from .errors import AioError
from .files import OpenFile, fsync_dir, open_file
from .handle import AioHandle, FileWriter, as_bytes_view, shared_handle

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
    "ThreadEngine",
    "as_bytes_view",
    "create_engine",
    "fsync_dir",
    "libaio_status",
    "open_file",
    "shared_handle",
]
