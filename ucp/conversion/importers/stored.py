"""Tensors that are still on disk: a byte range of a foreign file, with a dtype and a shape.

Why: converting a DeepSpeed checkpoint only moves bytes. Its tensors are contiguous runs of its
``.pt`` archives (uncompressed zip members), so the importer can describe every parameter's
pieces as byte ranges and the writer can copy them, without torch (whose import alone takes
longer than the copy) and without holding any tensor in memory.

:class:`StoredTensor` offers the few view operations the importers use on torch tensors
(``numel``, ``reshape(-1)``, 1-d slices, ``view``, ``item``), so one piece of layout code serves
both. :class:`StoredLeaf` is a tensor given as flat parts (a parameter split over ZeRO
partitions), like a ``ucp.Shards`` of ``FlatShard`` views. Whatever this cheap path cannot
express (a cast, a missing buffer filled with zeros, a non-contiguous view) raises
:class:`NeedsTorch`, and the importer starts again with torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ucp.errors import CheckpointError
from ucp.format.dtypes import itemsize

if TYPE_CHECKING:
    import numpy as np

# ucp dtype name -> the numpy dtype of a small tensor read as values (bf16 is widened to float32 exactly)
_NUMPY = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}
MAX_VALUE_BYTES = 1 << 20  # item()/tolist() read values for metadata, never a whole weight


class NeedsTorch(CheckpointError):
    """The on-disk path cannot express this; read the checkpoint with torch instead (the message says why).

    Internal: the importers catch it and read the checkpoint again with torch; it never reaches a caller.
    """


@dataclass(frozen=True)
class StoredTensor:
    """A contiguous tensor at ``[offset, offset + nbytes)`` of ``file`` (little-endian elements)."""

    file: str
    offset: int
    dtype: str  # a ucp dtype name (ucp.format.dtypes)
    shape: tuple[int, ...]

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * itemsize(self.dtype)

    def __reduce__(self) -> tuple[Any, ...]:
        """Copies and pickles are rebuilt from the fields (never through ``__setstate__``)."""
        return (StoredTensor, (self.file, self.offset, self.dtype, self.shape))

    def __setstate__(self, state: Any) -> None:
        """A foreign pickle's BUILD on a tensor it rebuilt would repoint it (another file, offset): refused."""
        raise NeedsTorch("a pickle that sets the fields of a tensor")

    def detach(self) -> "StoredTensor":
        return self

    def view(self, *shape: Any) -> "StoredTensor":
        """The same bytes seen with another shape; one dimension may be -1 (not with zero elements)."""
        dims = [int(d) for d in (shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)]
        if dims.count(-1) > 1 or any(d < -1 for d in dims):
            raise ValueError(f"invalid shape {dims}")
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            if known == 0:
                raise ValueError(f"shape {dims} is ambiguous for {self.numel()} elements")
            dims[dims.index(-1)] = self.numel() // known
        if math.prod(dims) != self.numel():
            raise ValueError(f"cannot view {self.numel()} elements as shape {dims}")
        return StoredTensor(self.file, self.offset, self.dtype, tuple(dims))

    reshape = view

    def __getitem__(self, key: slice) -> "StoredTensor":
        """A 1-d slice with step 1 (what partition arithmetic takes)."""
        if not isinstance(key, slice) or self.dim() != 1 or key.step not in (None, 1):
            raise NeedsTorch(f"indexing {key!r} of a {self.dim()}-d stored tensor")
        start, stop, _ = key.indices(self.shape[0])
        stop = max(start, stop)
        return StoredTensor(self.file, self.offset + start * itemsize(self.dtype), self.dtype, (stop - start,))

    def numpy(self) -> np.ndarray:
        """The values (bf16 widened to float32), for small tensors in metadata (a step count, a scale).
        Imports numpy only when called: a conversion that copies bytes needs none."""
        import numpy as np

        if self.dtype not in _NUMPY:
            raise NeedsTorch(f"values of a {self.dtype} tensor")
        if self.nbytes > MAX_VALUE_BYTES:
            raise NeedsTorch(f"values of a {self.nbytes}-byte tensor")
        with open(self.file, "rb") as fh:
            data = os.pread(fh.fileno(), self.nbytes, self.offset)
        if len(data) != self.nbytes:
            raise NeedsTorch(f"{self.file!r} ends before byte {self.offset + self.nbytes}")
        values = np.frombuffer(data, dtype=_NUMPY[self.dtype])
        if self.dtype == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return values.reshape(self.shape)

    def item(self) -> Any:
        if self.numel() != 1:
            raise ValueError(f"item() of a tensor of {self.numel()} elements")
        return self.numpy().reshape(()).item()

    def tolist(self) -> Any:
        return self.numpy().tolist()


@dataclass(frozen=True)
class StoredLeaf:
    """A tensor of ``shape`` given as flat parts ``(1-d stored tensor, index of its first element)``."""

    parts: tuple[tuple[StoredTensor, int], ...]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.parts[0][0].dtype

    def detach(self) -> "StoredLeaf":
        return self


def stored_leaf(parts: Sequence[tuple[StoredTensor, int]], shape: Sequence[int]) -> StoredTensor | StoredLeaf:
    """Like :func:`ucp.conversion.importers.common.leaf` for stored parts: the part itself when it covers the tensor."""
    shape = tuple(int(s) for s in shape)
    parts = tuple((v, int(s)) for v, s in parts if v.numel() > 0)
    if not parts:
        raise NeedsTorch(f"an empty tensor of shape {list(shape)}")
    if len({v.dtype for v, _ in parts}) > 1:
        raise NeedsTorch("parts of one tensor in different dtypes")
    if len(parts) == 1 and parts[0][1] == 0 and parts[0][0].numel() == math.prod(shape):
        return parts[0][0].view(shape)
    return StoredLeaf(parts, shape)


def is_stored(value: Any) -> bool:
    return isinstance(value, (StoredTensor, StoredLeaf))
