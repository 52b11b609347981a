"""``ucp.open(path)``: a checkpoint's tensors one at a time, like ``safetensors.safe_open``.

::

    with ucp.open("ckpt/step-100") as f:
        f.keys()                               # logical tensor names, e.g. "model.layers.0.wq"
        w = f.get_tensor("model.embed")        # the whole tensor, pieces assembled, CRC-checked
        rows = f.get_slice("model.embed")[1000:1064]   # only those rows' bytes are read

Built on the ``into=`` planner (:func:`ucp.loading.partial.read_targets`): a request is a target
region of one logical tensor, and only the stored pieces that intersect it are read. A slice is
a box of the tensor; the planner reads, of each piece, the span between the first and last
element the box needs (one run of bytes for a row slice, rounded out to 4 KiB where staged), so a
slice of a large tensor costs about its own size. The CRC-32C stored per piece covers the whole
piece: whole-tensor reads (``get_tensor``) are checked when ``verify`` (the default); slice reads
are not, since checking them would mean reading the whole pieces they touch.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

import torch

from reshard.box import Box
from ucp.errors import CheckpointError, LayoutMismatchError
from ucp.format.dtypes import torch_dtype
from ucp.format.manifest import Manifest, TensorEntry
from ucp.loading.partial import SourceIndex, Target, read_targets
from ucp.store.reader import check_data_files, read_manifest
from ucp.store.storage import Storage, as_aio_config, open_storage


def open(  # noqa: A001 - ucp.open mirrors safetensors.safe_open / builtins.open on purpose
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    aio_config: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointReader:
    """A lazy reader of the checkpoint at ``path``: its manifest is read (and every data file's size
    checked) now, tensors when asked for. Close it (or use ``with``) to release the storage."""
    storage, name = open_storage(path, storage_options=storage_options, aio_config=as_aio_config(aio_config))
    try:
        manifest = read_manifest(storage, name)
        check_data_files(storage, name, manifest)
    except BaseException:
        storage.close()
        raise
    return CheckpointReader(storage, name, manifest, verify=verify)


class CheckpointReader:
    """Tensors of one checkpoint on demand (see :func:`open`). Not thread-safe: one reader per thread."""

    def __init__(self, storage: Storage, name: str, manifest: Manifest, *, verify: bool = True) -> None:
        self._storage, self._name, self.manifest, self.verify = storage, name, manifest, verify
        self._index = SourceIndex.of(manifest)  # pieces per tensor, and the files whose headers were checked
        self._closed = False

    def keys(self) -> list[str]:
        """The logical tensor names, in manifest order (the names ``ucp.save`` gave the leaves)."""
        return list(self.manifest.tensors)

    def metadata(self) -> dict[str, Any]:
        """The checkpoint's free-form metadata (``manifest.metadata``)."""
        return dict(self.manifest.metadata)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (dtype as stored, on CPU), its pieces assembled; CRC-checked when ``verify``."""
        entry = self._entry(name)
        out = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        self._read(name, out, Box.full(tuple(entry.shape)), verify=self.verify)
        return out

    def get_slice(self, name: str) -> TensorSlice:
        """A handle on tensor ``name``: index it (``[a:b, :, 3]``) to read just that part."""
        return TensorSlice(self, name, self._entry(name))

    def _entry(self, name: str) -> TensorEntry:
        self._check_open()
        entry = self.manifest.tensors.get(name)
        if entry is None:
            close = difflib.get_close_matches(name, list(self.manifest.tensors), n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise LayoutMismatchError(
                f"tensor {name!r} is not in the checkpoint {self._storage.describe(self._name)} "
                f"({len(self.manifest.tensors)} tensors; keys() lists them){hint}",
                tensor=name,
            )
        return entry

    def _read(self, name: str, out: torch.Tensor, box: Box, *, verify: bool) -> None:
        # a fresh claim set per request (each request checks the pieces it reads whole), the piece
        # index and the checked headers shared
        index = dataclasses.replace(self._index, claimed=set(), running={})
        read_targets(self._storage, self._name, self.manifest, [Target(name, out, box, ())], verify=verify, index=index)
        index.finish(self._storage, self._name)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self._storage.describe(self._name)}: the reader is closed")

    def close(self) -> None:
        """Release the storage (idempotent)."""
        if not self._closed:
            self._closed = True
            self._storage.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({self._storage.describe(self._name)!r}, {len(self.manifest.tensors)} tensors)"


class TensorSlice:
    """One tensor of a :class:`CheckpointReader`, read part by part: ``s[0:8]``, ``s[:, 2]``, ``s[..., ::2]``.

    Indexing takes ints, slices (any step; the box between the first and last selected element is
    read, then stepped) and one Ellipsis, like a tensor; the result is a new CPU tensor."""

    def __init__(self, reader: CheckpointReader, name: str, entry: TensorEntry) -> None:
        self._reader, self.name, self._entry = reader, name, entry

    def get_shape(self) -> list[int]:
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        """The stored dtype as the format names it (safetensors names: ``"F32"``, ``"BF16"``...)."""
        return self._entry.dtype

    def __getitem__(self, key: Any) -> torch.Tensor:
        shape = tuple(self._entry.shape)
        offsets, sizes, then = _box_of(key, shape, self.name)
        out = torch.empty(sizes, dtype=torch_dtype(self._entry.dtype))
        if out.numel():
            self._reader._check_open()
            self._reader._read(self.name, out, Box.of(offsets, sizes), verify=False)
        return out[then] if then else out


def _box_of(key: Any, shape: tuple[int, ...], name: str) -> tuple[list[int], list[int], tuple[Any, ...]]:
    """The box to read for ``tensor[key]`` and the index to apply to it afterwards (steps, dropped dims)."""
    items = list(key) if isinstance(key, tuple) else [key]
    if sum(k is Ellipsis for k in items) > 1:
        raise LayoutMismatchError(f"tensor {name!r}: an index can hold only one Ellipsis", tensor=name)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        raise LayoutMismatchError(
            f"tensor {name!r}: too many indices ({len(items)}) for a tensor of {len(shape)} dimensions", tensor=name
        )
    items += [slice(None)] * (len(shape) - len(items))
    offsets: list[int] = []
    sizes: list[int] = []
    then: list[slice | int] = []
    stepped = False
    for dim, (k, n) in enumerate(zip(items, shape)):
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            if step <= 0:
                raise LayoutMismatchError(
                    f"tensor {name!r}: slice steps must be positive (dimension {dim})", tensor=name
                )
            count = len(range(start, stop, step))
            offsets.append(start if count else 0)
            sizes.append((count - 1) * step + 1 if count else 0)
            then.append(slice(None, None, step))
            stepped = stepped or step != 1
        elif isinstance(k, int) and not isinstance(k, bool):
            i = k + n if k < 0 else k
            if not 0 <= i < n:
                raise LayoutMismatchError(
                    f"tensor {name!r}: index {k} is out of range for dimension {dim} of size {n}", tensor=name
                )
            offsets.append(i)
            sizes.append(1)
            then.append(0)
            stepped = True
        else:
            raise LayoutMismatchError(
                f"tensor {name!r}: cannot index with {type(k).__name__} (ints, slices and ... only)", tensor=name
            )
    return offsets, sizes, tuple(then) if stepped else ()
